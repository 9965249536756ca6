"""Mamba (and other recurrent) layers: one state per request, whatever the
length; prefix hits only where a state checkpoint was saved.

Per request the group holds `[read, write]`: `read` has the state after
`num_computed` tokens (None: the zero state of an empty prefix) and `write`
receives the state after the next forward pass. When `read` is private the
update happens in place (`write is read`); when it is shared (a prefix hit,
a fork, or a block just cached as a checkpoint) the pass reads one block and
writes a fresh one, so saving or sharing a state never costs a copy.

A checkpoint is the state block at a block-aligned position, cached under
the chained key of the prefix it summarises. The checkpoint policy
(`core/checkpoints.py`) says where; the scheduler ends prefill chunks there.
"""

from __future__ import annotations

from .base import GroupManager


class MambaManager(GroupManager):
    kind = "mamba"

    def __init__(self, group, pool, caching, verify, policy):
        super().__init__(group, pool, caching, verify)
        self.policy = policy

    def empty_table(self):
        return [None, None]

    def _checkpoint(self, req, num_blocks):
        block = self.cached.get(req.keys[num_blocks - 1])
        if block is not None and self.verify:
            if block.tokens != tuple(req.tokens[:num_blocks * self.block_size]):
                return None
        return block

    def longest_hit(self, req, limit):
        checkpoint = self._checkpoint
        for n in range(limit, 0, -1):
            if checkpoint(req, n) is not None:
                return n
        return 0

    def hit_blocks(self, req, num_blocks):
        return [self._checkpoint(req, num_blocks)] if num_blocks else []

    def install_hit(self, req, blocks, num_blocks):
        read = blocks[0] if blocks else None
        if read is not None:
            self.pool.touch(read)
        req.tables[self.index] = [read, None]

    def _in_place(self, read) -> bool:
        return read is not None and read.ref_count == 1 and read.key is None

    def pages_needed(self, req, target):
        read, write = req.tables[self.index]
        if target <= req.num_computed or write is not None or self._in_place(read):
            return 0
        return self.width

    def pages_for_start(self, req, target, hit):
        # The first pass writes a fresh block: there is no state yet, or the
        # hit's checkpoint is cached and must stay as it is.
        return self.width if target > req.num_computed else 0

    def allocate(self, req, target, copies):
        state = req.tables[self.index]
        read, write = state
        if target <= req.num_computed or write is not None:
            return
        state[1] = read if self._in_place(read) else self.pool.allocate(self.width, 1)[0]

    def is_checkpoint(self, req, n) -> bool:
        if n == 0 or n % self.block_size:
            return False
        return n in req.checkpoints or (self.policy.rolling and n >= req.num_prompt_tokens)

    def on_computed(self, req):
        g = self.index
        read, write = req.tables[g]
        if write is None:
            return
        n = req.num_computed
        if self.caching and self.is_checkpoint(req, n):
            tokens = tuple(req.tokens[:n]) if self.verify else None
            if self.pool.cache(write, g, req.keys[n // self.block_size - 1], tokens):
                if self.policy.rolling and n >= req.num_prompt_tokens:
                    self._supersede(req, write)
        if read is not None and read is not write:
            self.pool.release(read)
        req.tables[g] = [write, None]

    def _supersede(self, req, checkpoint):
        g = self.index
        previous = req.rolling[g]
        req.rolling[g] = (checkpoint, checkpoint.key)
        if self.policy.supersede and previous is not None:
            block, key = previous
            # Only the newest state of a sequence is worth keeping for the
            # next turn; the older one would just push useful blocks out.
            # (The key check: a free block record may since hold other content.)
            if block.ref_count == 0 and block.key == key:
                self.pool.uncache(block)

    def free(self, req):
        read, write = req.tables[self.index]
        if write is not None and write is not read:
            self.pool.release(write)
        if read is not None:
            self.pool.release(read)
        req.tables[self.index] = self.empty_table()

    def fork(self, parent, child):
        read, write = parent.tables[self.index]
        if read is not None:
            self.pool.touch(read)
        child.tables[self.index] = [read, None]

    def held_blocks(self, req):
        read, write = req.tables[self.index]
        held = [read] if read is not None else []
        if write is not None and write is not read:
            held.append(write)
        return held
