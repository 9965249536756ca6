"""Recurrent layers of every kind (Mamba-1 and -2, short convolutions, Gated
DeltaNet: core/specs.py, RECURRENT_KINDS): one state per request, whatever
the length; prefix hits only where a state checkpoint was saved. The rule
is the same for every kind: the manager never looks inside a state.

Per request the group holds `[read, write]`: `read` has the state after
`num_computed` tokens (None: the zero state of an empty prefix) and `write`
receives the state after the next forward pass. When `read` is private the
update happens in place (`write is read`); when it is shared (a prefix hit,
a fork, or a block just cached as a checkpoint) the pass reads one block and
writes a fresh one, so saving or sharing a state never costs a copy.

A checkpoint is the state block at a block-aligned position, cached under
the chained key of the prefix it summarises. The checkpoint planner
(`core/checkpoints.py`) says where. A checkpoint at the end of a chunk is
the write block itself. With `inside` (the runner saves states inside a
chunk), a planned checkpoint strictly inside the allocated tokens gets a
block of its own (`req.saving`), which the pass writes the state at that
position into on its way and `on_computed` caches and lets go; without,
the scheduler ends prefill chunks at checkpoints. What the runner reads of
a request is its state pages (`state_pages`): where to read the state
from, where to write the next one, and where to save the states inside
the chunk (`saving_pages`).
"""

from __future__ import annotations

from ..page_allocator import NULL
from .base import NEVER, GroupManager


class _Checkpoints:
    """A recurrent group's scan, `found` and mask in one, looked up when
    read: position j is the checkpoint after j + 1 blocks. Checkpoints are
    few and a hit wants the latest one at or before a bound, so `rfind`
    (the mask's one use: `longest_hit`) looks the keys up backwards from
    the bound, a window at a time, each window in C; most lookups find one
    within the first window rather than scanning the whole prompt. Valid
    while the scan is (Coordinator.scan: no key changed since)."""

    __slots__ = ("by_key", "keys", "low", "mask")

    def __init__(self, by_key: dict, keys: list, limit: int):
        self.by_key, self.keys = by_key, keys
        self.low = limit  # positions [low, limit) are looked up, as `mask`
        self.mask = b""

    def __getitem__(self, j: int):
        return self.by_key.get(self.keys[j])

    def rfind(self, value: int, start: int, end: int) -> int:
        """bytes.rfind(1, start, end) over the mask of the scan (`end` at
        most its limit)."""
        while True:
            low = self.low
            if end > low:
                found = self.mask.rfind(value, max(start - low, 0), end - low)
                if found >= 0:
                    return found + low
            if low <= start:
                return -1
            below = max(start, low - max(16, len(self.mask)))  # windows double
            self.mask = bytes(map(self.by_key.__contains__, self.keys[below:low])) + self.mask
            self.low = below


class MambaManager(GroupManager):
    kind = "mamba"  # per group: the mixer's kind ("mamba2", "short_conv", ...)
    recurrent = True

    def __init__(self, group, block_cache, caching, verify, planner):
        super().__init__(group, block_cache, caching, verify)
        self.kind = group.kind
        self.planner = planner  # None without prefix caching: no checkpoints
        self.inside = False  # the runner saves states at checkpoints inside a chunk (set by the coordinator)

    def empty_table(self):
        return [NULL, NULL]  # [read, write]; NULL read = the zero state

    def _checkpoint(self, req, num_blocks):
        block = self.by_key.get(req.keys[num_blocks - 1])
        if block is not None and self.verify:
            if self.block_cache.tokens[block] != tuple(req.tokens[:num_blocks * self.block_size]):
                return None
        return block

    def found(self, req, lo, hi):
        # A hit of n blocks reads the checkpoint under key n - 1: position j
        # here is the checkpoint after j + 1 blocks.
        if not self.verify:
            return super().found(req, lo, hi)
        return [self._checkpoint(req, j + 1) for j in range(lo, hi)]

    def scan(self, req, limit):
        if self.verify or self.tier_index is not None:
            return super().scan(req, limit)
        scan = _Checkpoints(self.by_key, req.keys, limit)
        return scan, scan

    def longest_hit(self, mask, limit):
        # The latest checkpoint at or before the limit.
        return mask.rfind(1, 0, limit) + 1

    def hit_start(self, num_blocks: int) -> int:
        """A hit of n blocks needs one thing: the checkpoint under key n - 1."""
        return num_blocks - 1

    def hit_blocks(self, found, num_blocks):
        return [found[num_blocks - 1]] if num_blocks else []

    def install_hit(self, req, blocks, num_blocks):
        read = blocks[0] if blocks else NULL
        if read:
            self.block_cache.touch(read)
        req.tables[self.index] = [read, NULL]
        req.tables_changed()

    def place_loaded(self, req, position, block):
        req.tables[self.index][0] = block  # the state to read: the checkpoint loaded
        req.tables_changed()

    def _in_place(self, read) -> bool:
        return read != NULL and self.block_cache.ref[read] == 1 and self.block_cache.key[read] is None

    def _unsaved(self, req, target) -> list[int]:
        """Checkpoints strictly inside the tokens up to `target` that have
        no block yet (only where the runner saves states inside a chunk)."""
        if not self.inside:
            return []
        saving = req.saving[self.index]
        after = saving[-1][0] if saving else req.num_computed
        return self.planner.inside(req, after, target)

    def blocks_needed(self, req, target):
        read, write = req.tables[self.index]
        inside = len(self._unsaved(req, target))
        if target <= req.num_computed or write or self._in_place(read):
            return inside
        return 1 + inside

    def blocks_for_start(self, req, target, hit):
        # The first pass writes a fresh block: there is no state yet, or the
        # hit's checkpoint is cached and must stay as it is. (The planner
        # plans once per lookup: the one the scheduler's next_chunk made.)
        if target <= req.num_computed:
            return 0
        if self.inside:
            self.planner.plan(req, req.num_computed)
        return 1 + len(self._unsaved(req, target))

    def start(self, req, blocks):
        if blocks:
            req.tables[self.index][1] = blocks[0]
            req.tables_changed()
            if len(blocks) > 1:  # the first checkpoints past the hit, as blocks_for_start counted them
                positions = [p for p in req.checkpoints if p > req.num_computed]
                req.saving[self.index] = tuple(zip(positions, blocks[1:]))

    def allocate(self, req, target, copies, blocks):
        # `blocks`: one for each unsaved checkpoint, then the state block
        # if one is needed (blocks_needed counted them so).
        state = req.tables[self.index]
        read, write = state
        unsaved = self._unsaved(req, target)
        if unsaved:
            req.saving[self.index] += tuple(zip(unsaved, blocks))
        if target <= req.num_computed or write:
            return
        state[1] = read if self._in_place(read) else blocks[len(unsaved)]
        req.tables_changed()

    def _store_checkpoint(self, req, n: int, block: int) -> bool:
        """Cache `block`, the state after `n` tokens, under the key of
        block n / block_size - 1 (False: that key is cached already)."""
        tokens = [tuple(req.tokens[:n])] if self.verify else None
        j = n // self.block_size - 1
        token_ids = None
        if self.block_cache.events is not None:
            token_ids = req.tokens[j * self.block_size:(j + 1) * self.block_size]
        return bool(self.block_cache.store(self.index, [block], [req.keys[j]], tokens,
                                           parent=req.keys[j - 1] if j else req.root, token_ids=token_ids))

    def _settle_saving(self, req) -> None:
        """After a pass: the states it saved inside its chunk are cached
        (if no other block holds their key) and let go at once, the
        prompt-end one on probation (see core/checkpoints.py); one the
        computed tokens did not reach (the pass stopped short of it) is
        dropped unread."""
        g = self.index
        n = req.num_computed
        for position, block in req.saving[g]:
            cached = position <= n and self._store_checkpoint(req, position, block)
            self.block_cache.release(block, probation=cached and position == req.probation_at)
        req.saving[g] = ()

    def on_computed(self, req):
        g = self.index
        if req.saving[g]:
            self._settle_saving(req)
        state = req.tables[g]
        read, write = state
        if not write:
            return
        n = req.num_computed
        if self.caching and self.planner.is_checkpoint(req, n):
            if self._store_checkpoint(req, n, write):
                if self.planner.is_rolling(req, n):
                    self._supersede(req, write)
                if n == req.probation_at:
                    req.probation[g] = write
        if read and read != write:
            # The state we move on from goes on probation if it is the
            # prompt-end checkpoint (see core/checkpoints.py).
            self.block_cache.release(read, probation=read == req.probation[g])
        # The state now lives in `write`; the next pass updates it in place
        # unless it just became a cached checkpoint.
        state = [write, write if self._in_place(write) else NULL]
        if state != req.tables[g]:
            req.tables[g] = state
            req.tables_changed()

    def _supersede(self, req, checkpoint):
        g = self.index
        previous = req.rolling[g]
        req.rolling[g] = (checkpoint, self.block_cache.key[checkpoint])
        if self.planner.policy.supersede and previous is not None:
            block, key = previous
            # Only the newest state of a sequence is worth keeping for the
            # next turn; the older one would just push useful blocks out.
            # (The key check: the block id may since hold other content.)
            if self.block_cache.ref[block] == 0 and self.block_cache.key[block] == key:
                self.block_cache.evict([block], "superseded")

    def trim(self, req):
        # (A speculative step saves nothing inside: its drafts stop at a checkpoint.)
        if req.saving[self.index]:
            self._settle_saving(req)

    def free(self, req):
        for _, block in req.saving[self.index]:  # never written: not cached
            self.block_cache.release(block)
        req.saving[self.index] = ()
        read, write = req.tables[self.index]
        if write and write != read:
            self.block_cache.release(write)
        if read:
            self.block_cache.release(read)
        req.tables[self.index] = self.empty_table()

    def fork(self, parent, child):
        state = parent.tables[self.index]
        read = state[0]
        if read:
            self.block_cache.touch(read)
        # The state is shared now: neither may update it in place any more.
        state[1] = NULL
        parent.tables_changed()
        child.tables[self.index] = [read, NULL]

    events_follow_allocation = True  # a new state block takes over after the next pass

    def next_event(self, req):
        read, write = req.tables[self.index]
        if write and write != read:
            return req.num_computed + 1  # the new state block takes over after the pass
        if self.caching:
            return (req.num_computed // self.block_size + 1) * self.block_size  # a possible checkpoint
        return NEVER

    def room(self, req):
        # With a write block assigned the next pass has its state block
        # whatever its length; without one, allocate must assign it. Where
        # states are saved inside a chunk, tokens past the next checkpoint
        # without a block need one.
        room = NEVER if req.tables[self.index][1] != NULL else req.num_computed
        if self.inside:
            saving = req.saving[self.index]
            after = saving[-1][0] if saving else req.num_computed
            for position in req.checkpoints:
                if position > after:
                    return min(room, position)
        return room

    def state_pages(self, req) -> tuple:
        """(pages to read the state from, or None for the zero state; pages
        to write the next state into, or None before allocate_slots). The
        same pages when the update is in place."""
        read, write = req.tables[self.index]
        pages = self.block_cache.pages
        return (tuple(pages(read)) if read else None, tuple(pages(write)) if write else None)

    def saving_pages(self, req) -> list[tuple[int, tuple]]:
        """(position, pages) of each checkpoint inside the allocated tokens:
        the pass that computes past the position writes the state after it
        there."""
        pages = self.block_cache.pages
        return [(position, tuple(pages(block))) for position, block in req.saving[self.index]]

    def page_table(self, req):
        # The pages of the block holding the state (the write block once
        # assigned); empty before the first allocation.
        read, write = req.tables[self.index]
        block = write or read
        return list(self.block_cache.pages(block)) if block else []

    def held_blocks(self, req):
        read, write = req.tables[self.index]
        held = [read] if read else []
        if write and write != read:
            held.append(write)
        held.extend(block for _, block in req.saving[self.index])
        return held
