"""What the manager remembers about one request."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

# Table versions are unique across requests, so a runner's cached tables of a
# freed and re-added request id can never look current.
_versions = itertools.count(1)


class HitMemo(NamedTuple):
    """The last prefix lookup of a request that has not started, valid
    while no cache key changed and no token was appended."""
    version: int  # the block cache's version then
    num_tokens: int
    hit: int  # tokens
    why: tuple | None  # (alone, without) per group, once explain_hit asked


class ScanMemo(NamedTuple):
    """Per group, what the cache held for the request's block positions
    below the hit limit (Coordinator.scan)."""
    version: int
    limit: int  # blocks
    found: list  # per group: per position the cached block or None
    masks: list  # per group: the same as bytes (1 where cached)


class Lookup(NamedTuple):
    """The prefix hit a request took at its first allocation, and why."""
    prompt_tokens: int  # tokens known then
    hit: int
    alone: list  # per group: the longest hit it alone could serve
    without: list  # per group: the joint hit if it could serve anything
    loaded: dict | None = None  # tier -> per group, hit blocks loaded from it (None: all from the pool)


class FastPath(NamedTuple):
    """How far a started request's steps need nothing from the groups.
    `Coordinator._refresh` computes it after every slow path, the only code that changes
    a request's blocks, so it holds until the next one:
    * allocating tokens up to `room` (counted from position 0) needs no
      page, no copy and no new state block: they land in blocks the request
      holds alone (GroupManager.room);
    * marking tokens computed while num_computed stays below `quiet_until`
      completes no block a group caches, moves no block out of a window or
      chunk and hands over no state block (GroupManager.next_event).
    Appending tokens changes no block, so it leaves the bounds valid.
    `NO_FAST_PATH` (no room, never quiet: every call takes the slow path)
    is the value where the slow path must run: before the first
    allocation, after a fork (a shared partly filled block is copied on
    write), and while lookahead slots wait to be dropped."""
    room: int
    quiet_until: int


NO_FAST_PATH = FastPath(room=-1, quiet_until=-1)


@dataclass(slots=True, eq=False)
class CacheRequest:
    """Token ids, progress and, per group, the blocks a request holds.

    `tables[g]` is, for an attention group, the block table (position k
    holds tokens [k*block_size, (k+1)*block_size), the null block where the
    layer no longer needs them); for a Mamba group it is `[read, write]`:
    the block holding the state after `num_computed` tokens, and the block
    the next forward pass writes the new state into (the same block when the
    update can happen in place, the null block until slots are allocated).
    """

    request_id: str
    tokens: list[int]
    root: object  # the root of the request's key chain (its salt and extra keys)
    tables: list[list]
    num_prompt_tokens: int = 0
    num_computed: int = 0
    num_allocated: int = 0  # tokens that have slots: computed + scheduled
    lookahead: int = 0  # of those, draft tokens past the known ones (speculative decoding)
    started: bool = False  # the first allocation (which takes the hit) happened
    reads_cache: bool = True  # False: takes no prefix hit, computes every token (its blocks are still cached)
    keys: list = field(default_factory=list)  # chained cache keys of the full blocks of known tokens
    prompt_bytes: bytes | None = None  # canonical bytes of the prompt, for hashing
    # Per attention group: leading blocks already offered to the cache, and
    # leading blocks already released (they left the window or chunk).
    num_cached: list[int] = None
    num_released: list[int] = None
    # Mamba checkpoints (written by core/checkpoints.py and the Mamba manager):
    checkpoints: list[int] = field(default_factory=list)  # planned positions, ascending
    probation_at: int = -1  # the planned position whose state is released on probation
    planned_for: tuple | None = None  # what the plan was made from (CheckpointPlanner.plan)
    rolling: list = None  # per Mamba group: (block, key) of its latest decode checkpoint
    probation: list[int] = None  # per Mamba group: the probation checkpoint's block once saved
    # per Mamba group: (position, block) of the checkpoints inside the
    # allocated tokens, each written by the pass that computes past it
    saving: list = None
    hit_memo: HitMemo | None = None
    scan: ScanMemo | None = None
    lookup: Lookup | None = None
    fast: FastPath = NO_FAST_PATH  # how far steps skip the groups (set by the coordinator)
    table_version: int = 0  # renewed whenever a block table or a Mamba state block changes

    def __post_init__(self):
        self.num_prompt_tokens = len(self.tokens)
        groups = len(self.tables)
        self.num_cached = [0] * groups
        self.num_released = [0] * groups
        self.rolling = [None] * groups
        self.probation = [0] * groups
        self.saving = [()] * groups
        self.table_version = next(_versions)

    def tables_changed(self) -> None:
        self.table_version = next(_versions)

    def inherit(self, parent: CacheRequest) -> None:
        """Take the parent's progress at a fork (`INHERITED`, lists copied)."""
        for name in INHERITED:
            value = getattr(parent, name)
            setattr(self, name, list(value) if isinstance(value, list) else value)


# What a forked child takes from its parent: its progress and its plans.
INHERITED = ("num_prompt_tokens", "num_computed", "num_allocated", "started", "keys",
             "num_cached", "num_released", "checkpoints", "probation_at", "lookup")
# What it does not, and why: its id; tokens and root (given to the child as
# it is made); reads_cache (a started request looks nothing up); tables
# (the managers share the blocks, counting references);
# table_version (its own); lookahead (none between steps, where forks
# happen); prompt_bytes (the keys are inherited); the lookup memos hit_memo
# and scan (a started request looks nothing up), and planned_for (it
# plans nothing more; its plan, checkpoints, is inherited); fast (the child's first
# step takes the slow path, which copies a shared partly filled block);
# rolling and probation (checkpoints this request saved: the child saved none);
# saving (a checkpoint being written: none between steps, where forks happen).
NOT_INHERITED = ("request_id", "tokens", "root", "reads_cache", "tables", "table_version", "lookahead", "prompt_bytes",
                 "hit_memo", "scan", "fast", "rolling", "probation", "planned_for", "saving")
