"""The one pool of pages, the LRU free queue and the cache-key maps.

A `Block` is what a group allocates: `block_size` tokens of every layer of
the group (or one recurrent state), stored in `len(pages)` pages. Ref counts,
cache keys and the LRU queue all work on blocks; pages are only where the
bytes live. Page 0 is the null page: the null blocks (one per width) point at
it and stand in block tables for positions a layer no longer needs.

Free queue. One queue, ordered least recently freed first. A block whose
ref count drops to 0 keeps its cached content and goes to the tail; a block
with nothing cached goes to the head, since keeping it gains nothing.
Allocation first takes never-used pages, then blocks from the head; a block
taken from the queue loses its cache key. When a group needs a block of a
different width than the head block, the head block's pages are split or
combined: pages are interchangeable, so no group can starve while another
holds idle memory. Every operation is O(1) per block (or page) it touches.
"""

from __future__ import annotations

from collections import OrderedDict


class Block:
    __slots__ = ("pages", "ref_count", "key", "group", "tokens")

    def __init__(self, pages: tuple[int, ...], ref_count: int = 0):
        self.pages = pages
        self.ref_count = ref_count
        self.key = None  # cache key while cached, else None
        self.group = -1  # group whose key map holds it, while cached
        self.tokens = None  # token ids, kept only when the hash is not trusted

    @property
    def block_id(self) -> int:
        return self.pages[0]

    def __repr__(self) -> str:
        cached = "" if self.key is None else " cached"
        return f"Block(pages={self.pages}, ref={self.ref_count}{cached})"


class BlockPool:
    def __init__(self, num_pages: int, num_groups: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs the null page and at least one more, got {num_pages} pages")
        self.num_pages = num_pages
        self.num_free_pages = num_pages - 1
        self._next_fresh = 1  # pages [_next_fresh, num_pages) were never handed out
        self._free: OrderedDict[Block, None] = OrderedDict()
        self.cached: list[dict] = [{} for _ in range(num_groups)]
        # Bumped whenever a cache key disappears, so a remembered prefix hit
        # can tell that it may no longer be valid.
        self.version = 0
        self.num_evictions = 0
        self._null: dict[int, Block] = {}

    # -- null blocks -------------------------------------------------------
    def null_block(self, width: int) -> Block:
        block = self._null.get(width)
        if block is None:
            block = self._null[width] = Block((0,) * width, ref_count=1)
        return block

    def is_null(self, block: Block) -> bool:
        return block.pages[0] == 0

    # -- allocation --------------------------------------------------------
    def allocate(self, width: int, count: int) -> list[Block]:
        """`count` new blocks of `width` pages, ref count 1. The caller has
        checked that `num_free_pages` suffices."""
        need = width * count
        if need > self.num_free_pages:
            raise RuntimeError(f"allocate: {need} pages asked, {self.num_free_pages} free (caller must check)")
        self.num_free_pages -= need
        fresh = min(need, self.num_pages - self._next_fresh)
        if fresh == need and width == 1:
            start = self._next_fresh
            self._next_fresh += need
            return [Block((p,), 1) for p in range(start, start + need)]
        pages: list[int] = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        free = self._free
        while len(pages) < need:
            block = free.popitem(last=False)[0]
            if block.key is not None:
                self._drop_key(block)
            if count == 1 and not pages and len(block.pages) == width:
                block.ref_count = 1  # exact fit: reuse the record as it is
                return [block]
            pages.extend(block.pages)
        if len(pages) > need:
            rest = Block(tuple(pages[need:]))
            free[rest] = None
            free.move_to_end(rest, last=False)
            del pages[need:]
        if width == 1:
            return [Block((p,), 1) for p in pages]
        return [Block(tuple(pages[i:i + width]), 1) for i in range(0, need, width)]

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix hit or a fork)."""
        if block.ref_count == 0:
            del self._free[block]
            self.num_free_pages -= len(block.pages)
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block] = None
            if block.key is None:
                self._free.move_to_end(block, last=False)
            self.num_free_pages += len(block.pages)

    # -- the cache ---------------------------------------------------------
    def cache(self, block: Block, group: int, key, tokens=None) -> bool:
        """Register a computed block under `key` in `group`'s map. False if
        another block already holds that content (the first one stays)."""
        table = self.cached[group]
        if key in table or block.key is not None:
            return False
        table[key] = block
        block.key, block.group, block.tokens = key, group, tokens
        return True

    def uncache(self, block: Block) -> None:
        """Forget a block's content now (it is worth less than the LRU thinks)."""
        if block.key is None:
            return
        self._drop_key(block)
        if block.ref_count == 0:
            self._free.move_to_end(block, last=False)

    def _drop_key(self, block: Block) -> None:
        del self.cached[block.group][block.key]
        block.key, block.group, block.tokens = None, -1, None
        self.version += 1
        self.num_evictions += 1

    def reset_cache(self) -> int:
        dropped = 0
        for table in self.cached:
            for block in table.values():
                block.key, block.group, block.tokens = None, -1, None
            dropped += len(table)
            table.clear()
        self.version += 1
        return dropped

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(t) for t in self.cached)

    # -- checks for tests --------------------------------------------------
    def check_invariants(self, held: dict[Block, int]) -> None:
        """`held`: every block some request holds -> how many references the
        requests hold. Raises AssertionError on the first broken invariant:
        each page is free xor in exactly one held block, ref counts equal
        references, the key maps point only at blocks holding that key."""
        owner: dict[int, Block] = {}

        def claim(block: Block) -> None:
            for p in block.pages:
                assert p != 0, f"{block} uses the null page"
                assert p not in owner, f"page {p} is in {owner[p]} and {block}"
                owner[p] = block

        free_pages = 0
        for block in self._free:
            assert block.ref_count == 0, f"{block} is in the free queue with references"
            assert block not in held, f"{block} is free but a request holds it"
            claim(block)
            free_pages += len(block.pages)
        free_pages += self.num_pages - self._next_fresh
        assert free_pages == self.num_free_pages, f"free page count {self.num_free_pages} != {free_pages}"
        for block, refs in held.items():
            assert block.ref_count == refs, f"{block} has ref count {block.ref_count}, requests hold {refs}"
            claim(block)
        used = sum(len(b.pages) for b in held)
        assert used + free_pages == self.num_pages - 1, (
            f"pages leaked: {used} held + {free_pages} free != {self.num_pages - 1}")
        for g, table in enumerate(self.cached):
            for key, block in table.items():
                assert block.key == key and block.group == g, f"cache map entry {key!r} points at {block}"
                assert block.ref_count > 0 or block in self._free, f"cached {block} is neither held nor free"
