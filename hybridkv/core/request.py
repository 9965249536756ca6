"""What the manager remembers about one request."""

from __future__ import annotations

import itertools

# Table versions are unique across requests, so a runner's cached tables of a
# freed and re-added request id can never look current.
_versions = itertools.count(1)


class CacheRequest:
    """Token ids, progress and, per group, the blocks a request holds.

    `tables[g]` is, for an attention group, the block table (position k
    holds tokens [k*block_size, (k+1)*block_size), the null block where the
    layer no longer needs them); for a Mamba group it is `[read, write]`:
    the block holding the state after `num_computed` tokens, and the block
    the next forward pass writes the new state into (the same block when the
    update can happen in place, None until slots are allocated).
    """

    __slots__ = (
        "request_id", "tokens", "num_prompt_tokens", "num_computed", "num_allocated",
        "started", "keys", "root", "tables", "num_cached", "num_released",
        "checkpoints", "rolling", "hit_memo", "capacity", "steady", "next_event", "prompt_bytes", "table_version", "probation_at", "probation", "lookup", "lookahead", "scan",
    )

    def __init__(self, request_id: str, tokens: list[int], tables: list[list], root):
        self.request_id = request_id
        self.tokens = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed = 0
        self.num_allocated = 0  # tokens that have slots: computed + scheduled
        self.lookahead = 0  # of those, draft tokens past the known ones (speculative decoding)
        self.started = False  # the first allocation (which takes the hit) happened
        self.keys: list = []  # chained cache keys of the full blocks of known tokens
        self.root = root
        self.tables = tables
        num_groups = len(tables)
        self.num_cached = [0] * num_groups  # leading blocks already offered to the cache
        self.num_released = [0] * num_groups  # leading blocks already released (windows)
        self.checkpoints: list[int] = []  # planned Mamba checkpoint positions, ascending
        self.rolling: list = [None] * num_groups  # latest decode checkpoint per Mamba group
        self.probation_at = -1  # the checkpoint position whose state is released on probation
        self.probation = [0] * num_groups  # per Mamba group, that checkpoint's block once saved
        # (pool version, tokens known, hit, why or None) from the last lookup
        self.hit_memo = None
        self.scan = None  # (pool version, hit limit, found, masks): Coordinator.scan's memo
        # (prompt tokens, hit, (alone, without) per group) of the first allocation
        self.lookup = None
        # The decode fast path: while the next tokens fit in `capacity` and the
        # request is `steady`, allocation is a comparison; while num_computed
        # stays below `next_event`, marking tokens computed is an addition.
        self.capacity = 0
        self.steady = False
        self.next_event = 0
        self.prompt_bytes = None  # canonical bytes of the prompt, for hashing
        self.table_version = next(_versions)  # renewed whenever a block table or a Mamba state block changes

    def tables_changed(self) -> None:
        self.table_version = next(_versions)
