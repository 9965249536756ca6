"""What every per-group manager answers, and the shared attention logic.

A group manager knows one layer type's rules and nothing of the others:
* `scan(req, limit)`: per block position, the cached block a hit there
  would read (None where none is cached), and that as a mask; the
  coordinator asks once per lookup (`Coordinator.scan`) and hands the
  answer to the two below;
* `longest_hit(mask, limit)`: from that answer as a mask, the longest
  prefix, in blocks and at most `limit`, that this group can serve;
* `hit_blocks(found, n)`: the table prefix (null blocks where the type needs
  nothing) that serves a hit of `n` blocks;
* `blocks_needed` / `allocate`: room for tokens up to a target (the new blocks
  come from the coordinator, one call to the pool for every group);
* `on_computed`: after a forward pass, cache full blocks and release what
  the type will never read again;
* `free`;
* `page_table`: the pages the runner reads and writes for the request;
* for the coordinator's fast path (core/coordinator.py, `FastPath`):
  `room` and `next_event`, the bounds below which the group has no work.
The coordinator combines the groups; the block cache keeps the blocks.
"""

from __future__ import annotations

from ..block_cache import BlockCache
from ..layout import KVCacheGroup
from ..page_allocator import NULL
from ..request import CacheRequest
from ..specs import NEVER  # an event position no request reaches


class GroupManager:
    kind = "abstract"
    recurrent = False  # one state per request (core/managers/mamba.py), not a table over positions
    # Does `allocate` move next_event? (Only a new Mamba state block does:
    # attention events follow computed tokens, not allocated ones.)
    events_follow_allocation = False

    def __init__(self, group: KVCacheGroup, block_cache: BlockCache, caching: bool, verify: bool):
        self.group = group
        self.index = group.index
        self.block_size = group.block_size
        self.width = group.pages_per_block
        self.block_cache = block_cache
        self.caching = caching
        # With an untrusted hash, a hit must also match the stored token ids.
        self.verify = verify
        self.by_key = block_cache.cached[group.index]  # this group's cache keys -> blocks (read only)
        # The group's keys in the tier below the pool -> TierRef (core/tiers.py), or None.
        self.tier_index: dict | None = None

    def _lookup(self, req: CacheRequest, j: int) -> int | None:
        """The cached block for block position j of req, if any."""
        block = self.by_key.get(req.keys[j])
        if block is not None and self.verify:
            bs = self.block_size
            if self.block_cache.tokens[block] != tuple(req.tokens[j * bs:(j + 1) * bs]):
                return None
        return block

    def lookups(self, keys: list):
        """The pool's block for each key, else the tier's TierRef, else None
        (an iterator; maps run in C)."""
        if self.tier_index is None:
            return map(self.by_key.get, keys)
        return map(self.by_key.get, keys, map(self.tier_index.get, keys))

    def found(self, req: CacheRequest, lo: int, hi: int) -> list:
        """`_lookup` for block positions lo .. hi-1 (None where nothing is
        cached): with a trusted hash, one map over the keys, run in C."""
        if not self.verify:
            return list(self.lookups(req.keys[lo:hi]))
        return [self._lookup(req, j) for j in range(lo, hi)]

    def scan(self, req: CacheRequest, limit: int) -> tuple[list, bytes]:
        """`found` for positions below `limit`, and the same as a mask for
        `longest_hit` (bytes.find / rfind search it in C). A group may stop
        early where nothing after a position can matter to it (full
        attention: at the first miss); the mask then ends with that miss."""
        found = self.found(req, 0, limit)
        return found, bytes(map(bool, found))  # (block ids are never 0; a TierRef is truthy)

    def empty_table(self) -> list:
        return []

    # Each subclass implements these.
    def longest_hit(self, mask: bytes, limit: int) -> int:
        """`mask`: byte j is 1 where `found` gave a block for position j, 0
        where not; the scans search it with bytes.find / rfind (in C)."""
        raise NotImplementedError

    def hit_blocks(self, found: list, num_blocks: int) -> list[int]:
        raise NotImplementedError

    def install_hit(self, req: CacheRequest, blocks: list[int], num_blocks: int) -> None:
        raise NotImplementedError

    def blocks_needed(self, req: CacheRequest, target: int) -> int:
        """New blocks that `allocate(req, target, ...)` takes."""
        raise NotImplementedError

    def blocks_for_start(self, req: CacheRequest, target: int, hit: list[int]) -> int:
        """New blocks the first allocation takes after installing `hit`
        (not counting hit blocks that sit in the free queue)."""
        raise NotImplementedError

    def start(self, req: CacheRequest, blocks: list[int]) -> None:
        """The first allocation: `blocks_for_start` new blocks, from the pool."""
        raise NotImplementedError

    def allocate(self, req: CacheRequest, target: int, copies: list, blocks: list[int]) -> None:
        """Room for tokens up to `target`, with `blocks`: the
        `blocks_needed` new blocks, from the pool (the coordinator takes
        every group's in one call)."""
        raise NotImplementedError

    def on_computed(self, req: CacheRequest) -> None:
        raise NotImplementedError

    def free(self, req: CacheRequest) -> None:
        raise NotImplementedError

    def trim(self, req: CacheRequest) -> None:
        """Drop what was allocated past the computed tokens (the rejected
        drafts of a speculative step)."""

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        raise NotImplementedError

    def held_blocks(self, req: CacheRequest) -> list[int]:
        """Every non-null block the request references (for invariant checks)."""
        raise NotImplementedError

    def place_loaded(self, req: CacheRequest, position: int, block: int) -> None:
        """A block loaded from a tier takes its place in the request's hit:
        `position` is its index in the list `hit_blocks` gave."""
        raise NotImplementedError

    def page_table(self, req: CacheRequest) -> list[int]:
        """The pages the runner reads and writes for the request, in order."""
        raise NotImplementedError

    # The fast path (core/coordinator.py, FastPath): below these bounds the
    # group has nothing to do.
    def next_event(self, req: CacheRequest) -> int:
        """The smallest num_computed at which on_computed has work to do."""
        raise NotImplementedError

    def room(self, req: CacheRequest) -> int:
        """Tokens (from position 0) that allocate can cover with no work:
        they land in blocks the request holds alone, or need no block."""
        raise NotImplementedError

    def bounds(self, req: CacheRequest) -> tuple[int, int]:
        """(room, next_event): what the coordinator asks after a slow path."""
        return self.room(req), self.next_event(req)


class AttentionManager(GroupManager):
    """Block tables over positions. Which leading blocks a request no longer
    needs, and which a hit must hold, follow from the layer's read rule
    (`spec.first_visible`, core/specs.py); subclasses say how a hit is found."""

    def __init__(self, group, block_cache, caching, verify):
        super().__init__(group, block_cache, caching, verify)
        self.spec = group.spec
        self.released_pages = 0  # pages given back because no query reads them again
        # Does the read rule ever let a key go? (Full attention: never, so
        # the slow paths skip the release arithmetic.)
        self.releases = self.spec.last_reader(0) < NEVER

    def first_needed_block(self, num_computed: int) -> int:
        """Blocks before this index are never read again once `num_computed`
        tokens are computed (the next query is at position num_computed)."""
        return self.spec.first_visible(num_computed) // self.block_size

    def hit_start(self, num_blocks: int) -> int:
        """First block a hit of `num_blocks` blocks must hold (the rest is null)."""
        return self.first_needed_block(num_blocks * self.block_size)

    def release_event(self, req: CacheRequest) -> int:
        """The smallest num_computed at which first_needed_block passes the
        blocks already released: one past the last query that reads the
        last key of the first block still held."""
        last_key = (req.num_released[self.index] + 1) * self.block_size - 1
        reader = self.spec.last_reader(last_key)
        return NEVER if reader >= NEVER else reader + 1

    def next_event(self, req):
        return self.bounds(req)[1]

    def room(self, req):
        return self.bounds(req)[0]

    def bounds(self, req):
        # Room: up to the end of the last block held, unless the partly
        # filled block the next token lands in is shared (after a fork):
        # that one is copied before it is written, so nothing is free.
        # The next event: the next block to cache, or the next release.
        g = self.index
        bs = self.block_size
        table = req.tables[g]
        n = req.num_computed
        room = len(table) * bs
        if n % bs and n < room and self.block_cache.ref[table[n // bs]] > 1:
            room = n
        event = (req.num_cached[g] + 1) * bs if self.caching else NEVER
        if self.releases:
            release = self.release_event(req)
            if release < event:
                event = release
        return room, event

    def hit_blocks(self, found, num_blocks):
        start = self.hit_start(num_blocks)
        return [NULL] * start + found[start:num_blocks]

    def install_hit(self, req, blocks, num_blocks):
        self.block_cache.touch_all(blocks)
        g = self.index
        req.tables[g] = blocks
        req.tables_changed()
        req.num_cached[g] = num_blocks
        req.num_released[g] = self.hit_start(num_blocks)

    def blocks_needed(self, req, target):
        table = req.tables[self.index]
        new = -(-target // self.block_size) - len(table)
        if new < 0:
            new = 0
        return new + 1 if self._needs_copy(req, table, target) else new

    def blocks_for_start(self, req, target, hit):
        new = -(-target // self.block_size) - len(hit)
        return new if new > 0 else 0

    def start(self, req, blocks):
        if blocks:
            req.tables[self.index].extend(blocks)
            req.tables_changed()

    def _needs_copy(self, req, table, target) -> bool:
        """Is the partly filled block the next tokens land in shared (after a
        fork)? Then it is copied before it is written."""
        n = req.num_computed
        j = n // self.block_size
        return target > n and n % self.block_size != 0 and j < len(table) and self.block_cache.ref[table[j]] > 1

    def allocate(self, req, target, copies, blocks):
        if not blocks:
            return
        table = req.tables[self.index]
        # One block more than the new positions take: blocks_needed counted
        # a copy of the shared partly filled block (_needs_copy).
        new = -(-target // self.block_size) - len(table)
        if len(blocks) > (new if new > 0 else 0):
            j = req.num_computed // self.block_size
            shared = table[j]
            fresh = blocks[0]
            blocks = blocks[1:]
            copies.append((self.index, self.block_cache.pages(shared), self.block_cache.pages(fresh)))
            table[j] = fresh
            self.block_cache.release(shared)
        table += blocks
        req.tables_changed()

    def on_computed(self, req):
        g = self.index
        table = req.tables[g]
        n = req.num_computed
        if self.caching:
            full = n // self.block_size
            start = req.num_cached[g]
            if full > start:
                tokens = None
                if self.verify:
                    bs = self.block_size
                    tokens = [tuple(req.tokens[j * bs:(j + 1) * bs]) for j in range(start, full)]
                # keep_copies: where another request stored this content
                # first, ours stays findable after its block goes.
                parent = req.keys[start - 1] if start else req.root
                token_ids = None
                if self.block_cache.events is not None:
                    token_ids = req.tokens[start * self.block_size:full * self.block_size]
                self.block_cache.store(g, table[start:full], req.keys[start:full], tokens, keep_copies=True,
                                       parent=parent, token_ids=token_ids)
                req.num_cached[g] = full
        if not self.releases:
            return
        first = self.spec.first_visible(n) // self.block_size  # (first_needed_block, inline)
        start = req.num_released[g]
        if first > start:
            stop = min(first, len(table))
            if stop > start:
                leaving = table[start:stop]
                table[start:stop] = [NULL] * (stop - start)
                self.block_cache.release_all(leaving)
                self.released_pages += self.width * (stop - start - leaving.count(NULL))
            req.num_released[g] = first
            req.tables_changed()

    def trim(self, req):
        # Blocks past the one holding the last computed token hold only
        # rejected drafts: nothing was cached in them, they go to the head.
        table = req.tables[self.index]
        keep = -(-req.num_computed // self.block_size)
        if len(table) > keep:
            self.block_cache.release_all(table[keep:][::-1])
            del table[keep:]
            req.tables_changed()

    def free(self, req):
        # Last block first: it enters the free queue first and so is evicted
        # before the (more widely shared) blocks of the prefix. The released
        # ones before num_released are all null (KVCacheManager.check_invariants
        # holds it): a window's long run of them is skipped.
        g = self.index
        self.block_cache.release_all(req.tables[g][req.num_released[g]:][::-1])
        req.tables[g] = []

    def fork(self, parent, child):
        g = self.index
        table = list(parent.tables[g])
        self.block_cache.touch_all(table)
        child.tables[g] = table
        child.num_cached[g] = parent.num_cached[g]
        child.num_released[g] = parent.num_released[g]

    def held_blocks(self, req):
        return [b for b in req.tables[self.index] if b]

    def place_loaded(self, req, position, block):
        req.tables[self.index][position] = block
        req.tables_changed()

    def page_table(self, req):
        table = req.tables[self.index]
        if self.width == 1:
            return list(table)
        pages = self.block_cache.pages
        return [p for b in table for p in pages(b, self.width)]
