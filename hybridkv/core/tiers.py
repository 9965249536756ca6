"""Tiers below the pool, as the scheduler sees them: an index of what they
hold, and the copies a step plan carries to the worker.

The manager decides, the worker copies, and they meet only in a plan
(`TierPlan`) and its report (`TierReport`):
* `TierIndex.index[g]`: group g's keys the tiers hold -> a `TierRef`.
  Scans read it beside the pool's own key map, so a hit is the longest
  prefix every group can serve from the pool or a tier, by the same rule as
  on the pool alone. A lookup reads nothing else: no file, no byte.
* `put(group, key, pages)`: a block the pool is about to reuse (evicted by
  the LRU, or a checkpoint on probation) still holds its content in
  `pages`: the plan stores it before the step writes them, and the index
  holds the key from now on. Blocks superseded by their owner (older
  rolling Mamba checkpoints) are not offered: no hit can want them.
* `load(request_id, ref, pages)`: a hit took a tier block into
  fresh pool pages: the plan loads it before the step reads them.
* The worker makes the copies in that order (stores read every page they
  need before any load writes one) and reports what its tiers dropped or
  moved (`moves`) and which loads failed (`failed`): a failed load's key
  leaves the index, and the manager recomputes the requests that read its
  block (KVCacheManager.tier_loads_failed). Never wrong content.
* `clear()`: forget everything (reset_prefix_cache: the weights changed);
  the plan's first copy.

What a tier keeps follows from the pool: only cached blocks are evicted with
a key, so a tier sees, per type, exactly what a hit can use (full and
chunked-local attention blocks, sliding-window blocks, which are each the
last window of some prefix, and Mamba checkpoint states; never a live
request's running state). Keys are the pool's chained hashes, tenant salts
included, so a salted block is never served to another salt; tiers need a
trusted hash (SHA-256) since they keep no token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple


class TierRef(NamedTuple):
    """A block held in a tier (truthy, and never an int: scans tell it from
    a pool block by type)."""
    group: int
    key: bytes
    tier: str  # "host", "disk", ...


class BlockStore(NamedTuple):
    """Pool pages into the tiers, as block `key` of `group`."""
    group: int
    key: bytes
    pages: tuple


class BlockLoad(NamedTuple):
    """A tier block into fresh pool pages, for `request_id`'s hit (`tier`:
    where the index had it then)."""
    request_id: str
    group: int
    key: bytes
    pages: tuple
    tier: str = ""


@dataclass
class TierPlan:
    """The tier copies a step makes before its forward pass, in this order:
    `clear` (forget everything), the stores, the loads. `flush`: the stores
    go straight to disk (a server about to stop)."""
    stores: list[BlockStore] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    clear: bool = False
    flush: bool = False

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.clear)


@dataclass
class TierReport:
    """What a plan's copies did: the loads that failed on some rank (their
    indexes in the plan), and every change of what the tiers hold, in
    order, as (group, key, tier or None: gone)."""
    failed: list[int] = field(default_factory=list)
    moves: list[tuple] = field(default_factory=list)


class TierIndex:
    """What the tiers hold, as the scheduler knows it: the index its lookups
    read, the copies decided since the last plan, and the reports that keep
    the index exact."""

    def __init__(self, num_groups: int, first_tier: str, held: Iterable[tuple] = ()):
        # `first_tier`: where a stored block goes ("host", else "disk");
        # `held`: (group, key, tier) the tiers hold already (files of an
        # earlier run, by name: a damaged one fails its load).
        self.first_tier = first_tier
        self.index: list[dict] = [{} for _ in range(num_groups)]
        for group, key, tier in held:
            if group < num_groups:
                self.index[group][key] = TierRef(group, key, tier)
        self.changed = lambda: None  # set by the manager: a key left the index
        self._plan = TierPlan()

    def put(self, group: int, key: bytes, pages) -> None:
        self._plan.stores.append(BlockStore(group, key, tuple(pages)))
        if key not in self.index[group]:
            self.index[group][key] = TierRef(group, key, self.first_tier)

    def load(self, request_id: str, ref: TierRef, pages) -> None:
        self._plan.loads.append(BlockLoad(request_id, ref.group, ref.key, tuple(pages), ref.tier))

    def clear(self) -> None:
        """Forget everything. Stores decided before are dropped; loads
        decided before fail (their requests recompute)."""
        self._plan.stores.clear()
        self._plan.clear = True
        for index in self.index:
            index.clear()
        self.changed()

    def on_disk(self, group: int, key: bytes) -> bool:
        ref = self.index[group].get(key)
        return ref is not None and ref.tier == "disk"

    def learn(self, held: Iterable[tuple]) -> None:
        """Blocks another process put where these tiers read, (group, key,
        tier): the index holds them from now on (a damaged one fails its
        load like any other)."""
        added = False
        for group, key, tier in held:
            if key not in self.index[group]:
                self.index[group][key] = TierRef(group, key, tier)
                added = True
        if added:
            self.changed()  # a remembered hit may be longer now

    def take(self) -> TierPlan:
        """The copies decided since the last take, for the next plan."""
        plan, self._plan = self._plan, TierPlan()
        return plan

    def reported(self, plan: TierPlan, report: TierReport) -> list[BlockLoad]:
        """Apply a worker's report of `plan`: the index follows every move,
        a failed load's key leaves it. Returns the failed loads."""
        dropped = False
        for group, key, tier in report.moves:
            index = self.index[group]
            if tier is not None:
                index[key] = TierRef(group, key, tier)
            elif index.pop(key, None) is not None:
                dropped = True
        failed = [plan.loads[i] for i in report.failed]
        for load in failed:
            if self.index[load.group].pop(load.key, None) is not None:
                dropped = True
        if dropped:
            self.changed()
        return failed

    def __len__(self) -> int:
        return sum(len(index) for index in self.index)
