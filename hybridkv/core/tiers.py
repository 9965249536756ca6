"""Tiers below the pool: what the manager asks of a store that keeps
blocks the pool evicted (host memory, disk), and the rules it follows.

The manager stays torch-free: it decides what to keep and what to load, the
tier moves the bytes. The contract (`KVTier`):
* `index[g]`: group g's keys the tier holds -> a `TierRef`. Scans read it
  beside the pool's own key map, so a hit is the longest prefix every group
  can serve from the pool or a tier, by the same rule as on the pool alone.
* `put(group, key, pages)`: a block the pool is about to reuse (evicted by
  the LRU, or a checkpoint on probation) still holds its content in `pages`:
  keep a copy now (the pages are overwritten by the next forward pass).
  Blocks superseded by their owner (older rolling Mamba checkpoints) are
  not offered: no hit can want them.
* `fetch(ref)`: the content, or None if the tier lost it (budget, a corrupt
  or truncated file): then the tier drops the key and calls `changed()`, and
  the manager looks the hit up again. Never wrong content, never an error.
* `load(pages, content)`: write fetched content into fresh pool pages.
* `clear()`: forget everything (reset_prefix_cache: the weights changed).

What a tier keeps follows from the pool: only cached blocks are evicted with
a key, so a tier sees, per type, exactly what a hit can use (full and
chunked-local attention blocks, sliding-window blocks, which are each the
last window of some prefix, and Mamba checkpoint states; never a live
request's running state). Keys are the pool's chained hashes, tenant salts
included, so a salted block is never served to another salt; tiers need a
trusted hash (SHA-256) since they keep no token ids.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class TierRef(NamedTuple):
    """A block held in a tier (truthy, and never an int: scans tell it from
    a pool block by type)."""
    group: int
    key: bytes
    tier: str  # "host", "disk", ...


class KVTier(Protocol):
    index: list[dict]
    changed: object  # set by the manager: call it when a key leaves the index

    def put(self, group: int, key: bytes, pages) -> None: ...

    def fetch(self, ref: TierRef): ...

    def load(self, pages, content) -> None: ...

    def clear(self) -> None: ...
