"""KV events: what a manager's cache can serve, as it changes.

With events on (`KVCacheManager(..., enable_kv_events=True)`), every change
of the set of keys the pool can serve is recorded, in order, and
`kv.take_events()` hands them over: a consumer that applies them in order
knows, per group, which keys the manager holds, and a `PrefixIndex`
(core/prefix_index.py) over them computes the hit the manager would give.
The fields follow vLLM's KV event format (BlockStored / BlockRemoved /
AllBlocksCleared, with `group_idx` and the group's kind), so a router built
for vLLM's events reads these with the group information vLLM has a field
for. Only the pool's keys are reported: a tier below it is not.

Recorded where keys appear and disappear, and nowhere else: `BlockCache.store`
(a run of blocks of one group that became findable), `BlockCache.evict` (a
key no block serves any more: a key that moves to a live copy of its
content is still served, and is not reported), `BlockCache.reset`.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockStored(NamedTuple):
    """Consecutive blocks of one group's chain became findable."""
    block_hashes: list  # the blocks' keys, in chain order
    parent_block_hash: object  # the key before the first one (the chain's root for block 0)
    token_ids: list  # the blocks' tokens, one block after the other
    block_size: int
    group_idx: int
    kind: str  # "full", "sliding_window", "chunked_local", or a recurrent kind ("mamba", "mamba2", ...: a key
    #            stands for the state after its prefix)


class BlockRemoved(NamedTuple):
    """Keys of one group no block serves any more."""
    block_hashes: list
    group_idx: int


class AllBlocksCleared(NamedTuple):
    """Every key of every group is gone (reset_prefix_cache)."""
