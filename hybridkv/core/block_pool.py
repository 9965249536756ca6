"""The one pool of pages, the LRU free queue and the cache-key maps.

A block is what a group allocates: `block_size` tokens of every layer of the
group (or one recurrent state), stored in one or more pages. A block is named
by an int, its block id: the id of its first page. Ref counts, cache keys and
the LRU queue all work on blocks; pages are only where the bytes live. Page 0
is the null page, and block id 0 the null block: it stands in block tables
for positions a layer no longer needs, and is never allocated or freed.

Blocks are ints and their fields live in per-page lists indexed by block id,
so the hot paths create no Python objects per block (and the cyclic garbage
collector has nothing to scan).

Free queue. One queue, ordered least recently freed first. A block whose
ref count drops to 0 keeps its cached content and goes to the tail; a block
with nothing cached goes to the head, since keeping it gains nothing.
Allocation first takes never-used pages, then blocks from the head; a block
taken from the queue loses its cache key. When a group needs a block of
another width than the head block's, pages are split or combined: any page
can serve any group, so no group starves while another holds idle memory.
Every operation is O(1) per block (or page) it touches.

Copies of one content. Two requests that compute the same block before
either finds the other's hold two blocks with one key. The first is the
key's entry in the map; the others are remembered as its copies, so that
when the entry's block is evicted while a copy lives on, the key moves to
the copy and the content stays findable (a dict per key: O(1) to add, drop
or promote one).

Why keys leave the map is counted per group: `lru` (a free cached block
taken for new content), `probation` (the same, for a checkpoint released
on probation), `superseded` (dropped by its owner: an older rolling Mamba
checkpoint) and `reset` (reset_cache).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain

NULL = 0
EVICTION_REASONS = ("lru", "probation", "superseded", "reset")


class BlockPool:
    def __init__(self, num_pages: int, num_groups: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs the null page and at least one more, got {num_pages} pages")
        self.num_pages = num_pages
        self.num_free_pages = num_pages - 1
        self._next_fresh = 1  # pages [_next_fresh, num_pages) were never handed out
        # Per block id (= first page). Only a block's first page's entries mean anything.
        self.ref = [0] * num_pages
        self.key: list = [None] * num_pages  # cache key while cached
        self.key_group = [0] * num_pages  # the group whose map holds the key
        self.tokens: list = [None] * num_pages  # token ids, only when the hash is not trusted
        self._verified_tokens = False  # some block was cached with its token ids
        # A block's shape: its width in pages, and, when its pages are not
        # one run from its first page (it was put together from loose
        # pages), the runs they form, as ranges. Pages are only ever handled
        # as runs, so taking a block apart or cutting one out of loose pages
        # costs a few slice assignments in C, however wide the block.
        self.widths = [1] * num_pages
        self.runs: list = [None] * num_pages
        # The free queue: block -> released on probation (still cached, but
        # first to go). The flag rides in the queue, not in a per-page list,
        # because a popped block's own entry is the one place read anyway.
        self._free: OrderedDict[int, bool] = OrderedDict()
        self.cached: list[dict] = [{} for _ in range(num_groups)]
        # Per group, key -> {block: None}: other blocks holding the content of
        # the block that the map names (see "Copies of one content").
        self.copies: list[dict] = [{} for _ in range(num_groups)]
        # Bumped whenever a cache key appears, disappears or moves, so a
        # remembered prefix hit can tell that it may be stale.
        self.version = 0
        # Keys that left the map, per reason, per group.
        self.evictions = {reason: [0] * num_groups for reason in EVICTION_REASONS}

    def pages(self, block: int, width: int = 1):
        """The pages of a block (the null block's for the given width)."""
        if block == NULL:
            return (NULL,) * width
        runs = self.runs[block]
        return range(block, block + self.widths[block]) if runs is None else tuple(chain.from_iterable(runs))

    def width(self, block: int) -> int:
        return self.widths[block]

    # -- allocation --------------------------------------------------------
    def allocate(self, width: int, count: int) -> list[int]:
        """`count` new blocks of `width` pages, ref count 1. The caller has
        checked that `num_free_pages` suffices. (One width: a decode step's
        new block. `allocate_many` does the same for several widths; this
        copy of its loop without the per-width bookkeeping is what keeps
        the decode path at a few microseconds.)"""
        need = width * count
        if need > self.num_free_pages:
            raise RuntimeError(f"allocate: {need} pages asked, {self.num_free_pages} free (caller must check)")
        self.num_free_pages -= need
        ref, key, widths, runs = self.ref, self.key, self.widths, self.runs
        blocks: list[int] = []
        loose_pages: list = []  # pages of split blocks, as runs (ranges), in the order they were freed
        loose = 0
        fresh = min(need, self.num_pages - self._next_fresh)
        if fresh:
            start = self._next_fresh
            self._next_fresh += fresh
            whole = fresh // width
            if whole:
                self._fresh_blocks(start, width, whole, blocks)
            loose = fresh - whole * width
            if loose:
                loose_pages.append(range(start + whole * width, start + fresh))
        free = self._free
        have = len(blocks)
        key_group, cached, copies = self.key_group, self.cached, self.copies
        tokens = self.tokens if self._verified_tokens else None
        lru = self.evictions["lru"]
        evicted = 0
        while have + loose // width < count:
            block, probation = free.popitem(last=False)
            k = key[block]
            if k is not None:
                g = key_group[block]
                if copies[g] or probation:
                    self._drop_key(block, "probation" if probation else "lru")
                else:  # _drop_key's usual case, inline: this loop runs per block evicted
                    del cached[g][k]
                    key[block] = None
                    if tokens is not None:
                        tokens[block] = None
                    lru[g] += 1
                    evicted += 1
            block_width = widths[block]
            if block_width == width:
                ref[block] = 1  # the right width: reused as it is
                blocks.append(block)
                have += 1
                continue
            if runs[block] is None:
                loose_pages.append(range(block, block + block_width))
            else:
                loose_pages.extend(runs[block])
                runs[block] = None
            loose += block_width
        if evicted:
            self.version += 1
        if len(blocks) < count:
            loose_pages = self._cut(loose_pages, width, count - len(blocks), blocks)
        if loose_pages:
            self._free_rest(loose_pages)
        return blocks

    def _fresh_blocks(self, start: int, width: int, count: int, out: list) -> None:
        """`count` blocks of never-used pages from `start` on (runs) into
        `out`, ref count 1."""
        self._run_blocks(range(start, start + count * width), width, count, out)

    def _run_blocks(self, run: range, width: int, count: int, out: list) -> None:
        """`count` blocks of `width` pages from the start of a run of loose
        pages, ref count 1: slice assignments, loops in C however many.
        (A loose page holds no key and no other block's shape: keys and
        runs are cleared when a block is taken apart.)"""
        first = run[0]
        if count < 4:  # a decode step's block: plain stores are cheaper
            ref, widths = self.ref, self.widths
            for block in range(first, first + count * width, width):
                ref[block] = 1
                widths[block] = width
                out.append(block)
            return
        blocks = slice(first, first + count * width, width)
        self.ref[blocks] = [1] * count
        self.widths[blocks] = [width] * count
        out.extend(range(first, first + count * width, width))

    def _cut(self, loose_pages: list, width: int, count: int, out: list) -> list:
        """`count` blocks of `width` pages, ref count 1, from the loose
        pages (runs, in order) into `out`; returns the runs left. Blocks
        inside a run are runs; one that straddles runs is made of pieces."""
        carry: list = []  # runs of a block begun in an earlier run
        carried = 0
        ref, widths = self.ref, self.widths
        for i, run in enumerate(loose_pages):
            if not carried and len(run) == width:
                # A run one block wide (a block of this width popped as a
                # piece of a wider one): the usual run; plain stores.
                first = run.start
                ref[first] = 1
                widths[first] = width
                out.append(first)
                count -= 1
                if not count:
                    return loose_pages[i + 1:]
                continue
            at = 0
            if carried:
                at = width - carried
                if len(run) < at:
                    carry.append(run)
                    carried += len(run)
                    continue
                carry.append(run[:at])
                self._pieced_block(carry, width, out)
                carry, carried = [], 0
                count -= 1
            whole = min(count, (len(run) - at) // width)
            if whole:
                self._run_blocks(run[at:], width, whole, out)
                count -= whole
                at += whole * width
            if not count:
                rest = loose_pages[i + 1:]
                if at < len(run):
                    rest.insert(0, run[at:])
                return rest
            if at < len(run):
                carry.append(run[at:])
                carried += len(run) - at
        raise RuntimeError("allocate: fewer loose pages than counted")

    def _pieced_block(self, pieces: list, width: int, out: list) -> None:
        """A block (ref count 1, into `out`) of the runs `pieces`, adjacent
        ones joined."""
        first = pieces[0].start
        self.widths[first] = width
        if len(pieces) > 1:  # (one piece, the usual remainder, is a run as it is)
            joined = [pieces[0]]
            for run in pieces[1:]:
                last = joined[-1]
                if last.stop == run.start:
                    joined[-1] = range(last.start, run.stop)
                else:
                    joined.append(run)
            if len(joined) > 1:
                self.runs[first] = tuple(joined)
        self.ref[first] = 1
        out.append(first)

    def _free_rest(self, loose_pages: list) -> None:
        """Pages left over from splitting wider blocks: one free block at
        the queue's head, nothing cached. Its runs are kept as they come,
        not joined: the remainder passes from allocation to allocation,
        each cutting a few blocks off its front, and a joining loop over
        all its runs each time cost more than the few joins it finds."""
        rest = loose_pages[0].start
        self.widths[rest] = sum(map(len, loose_pages))
        if len(loose_pages) > 1:
            self.runs[rest] = tuple(loose_pages)
        self.ref[rest] = 0
        self._free[rest] = False
        self._free.move_to_end(rest, last=False)

    def allocate_many(self, needs) -> list[list[int]]:
        """New blocks for several groups at once (one admission): per
        (width, count) in `needs`, `count` blocks of `width` pages, ref
        count 1. The pages come from where one call per group would take
        them (never-used pages, then the queue's head), but a block popped
        from the queue goes to a group of its own width while one still
        wants blocks, and only the rest is cut: an admission whose oldest
        free blocks are of both widths takes them as they are."""
        want: dict[int, int] = {}
        for width, count in needs:
            if count:
                want[width] = want.get(width, 0) + count
        if len(want) <= 1:
            return [self.allocate(width, count) if count else [] for width, count in needs]
        need = sum(width * count for width, count in want.items())
        if need > self.num_free_pages:
            raise RuntimeError(f"allocate: {need} pages asked, {self.num_free_pages} free (caller must check)")
        self.num_free_pages -= need
        ref, key, widths, runs = self.ref, self.key, self.widths, self.runs
        got: dict[int, list[int]] = {width: [] for width in want}
        loose_pages: list = []  # pages of split blocks, as runs (ranges), in the order they were freed
        fresh = min(need, self.num_pages - self._next_fresh)
        if fresh:
            start = self._next_fresh
            self._next_fresh = end = start + fresh
            for width, count in want.items():
                whole = min(count, (end - start) // width)
                if whole:
                    self._fresh_blocks(start, width, whole, got[width])
                    want[width] = count - whole
                    start += whole * width
                    need -= whole * width
            if end > start:
                loose_pages.append(range(start, end))
        free = self._free
        loose = end - start if fresh else 0
        key_group, cached, copies = self.key_group, self.cached, self.copies
        tokens = self.tokens if self._verified_tokens else None
        lru = self.evictions["lru"]
        evicted = 0
        while need > loose:
            block, probation = free.popitem(last=False)
            k = key[block]
            if k is not None:
                g = key_group[block]
                if copies[g] or probation:
                    self._drop_key(block, "probation" if probation else "lru")
                else:  # as in allocate
                    del cached[g][k]
                    key[block] = None
                    if tokens is not None:
                        tokens[block] = None
                    lru[g] += 1
                    evicted += 1
            block_width = widths[block]
            if want.get(block_width):  # wanted at this width: reused as it is
                want[block_width] -= 1
                ref[block] = 1
                got[block_width].append(block)
                need -= block_width
                continue
            if runs[block] is None:
                loose_pages.append(range(block, block + block_width))
            else:
                loose_pages.extend(runs[block])
                runs[block] = None
            loose += block_width
        if evicted:
            self.version += 1
        for width, count in want.items():
            if count:
                loose_pages = self._cut(loose_pages, width, count, got[width])
        if loose_pages:
            self._free_rest(loose_pages)
        out = []
        taken: dict[int, int] = {}
        for width, count in needs:  # groups of one width share its list, in order
            at = taken.get(width, 0)
            out.append(got[width][at:at + count] if count else [])
            taken[width] = at + count
        return out

    def touch(self, block: int) -> None:
        """Take one more reference (a prefix hit or a fork)."""
        ref = self.ref
        if ref[block] == 0:
            del self._free[block]
            self.num_free_pages -= self.widths[block]
        ref[block] += 1

    def touch_all(self, table: list[int]) -> None:
        """`touch` every non-null block of a block table (a prefix hit, a
        fork). A block that another request holds, the usual case for a
        shared prefix, only counts one more reference."""
        ref, free, widths = self.ref, self._free, self.widths
        for block in table:
            if block:
                if ref[block]:
                    ref[block] += 1
                else:
                    del free[block]
                    self.num_free_pages -= widths[block]
                    ref[block] = 1

    def release(self, block: int, probation: bool = False) -> None:
        """One reference less. `probation`: the block stays cached but enters
        the free queue at the head, first to go if memory runs short (a
        checkpoint unlikely to be reused)."""
        ref = self.ref
        ref[block] -= 1
        if ref[block] == 0:
            self._free[block] = probation
            if probation or self.key[block] is None:
                self._free.move_to_end(block, last=False)
            self.num_free_pages += self.widths[block]

    # -- the cache ---------------------------------------------------------
    def cache(self, block: int, group: int, key, tokens=None, keep_copy: bool = False) -> bool:
        """Register a computed block under `key` in `group`'s map. False if
        another block already holds that content: that one stays the entry,
        and with `keep_copy` this block is remembered as a copy of it (an
        attention block another request keeps reading; a Mamba state moves
        on, so it is not kept)."""
        if self.key[block] is not None:
            return False
        table = self.cached[group]
        entry = key not in table
        if entry:
            table[key] = block
            self.version += 1
        elif keep_copy and (tokens is None or self.tokens[table[key]] == tokens):
            # (With an untrusted hash, equal keys may hold other tokens: a
            # collision is not a copy.)
            self.copies[group].setdefault(key, {})[block] = None
        else:
            return False
        self.key[block] = key
        self.key_group[block] = group
        if tokens is not None:
            self.tokens[block] = tokens
            self._verified_tokens = True
        return entry

    def uncache(self, block: int) -> None:
        """Forget a block's content now (it is worth less than the LRU thinks)."""
        if self.key[block] is None:
            return
        self._drop_key(block, "superseded")
        if self.ref[block] == 0:
            self._free.move_to_end(block, last=False)

    def _drop_key(self, block: int, reason: str) -> None:
        group, key = self.key_group[block], self.key[block]
        self.key[block] = None
        self.tokens[block] = None
        copies = self.copies[group]
        others = copies.get(key) if copies else None
        if others is None:  # the usual case: one block per key
            del self.cached[group][key]
            self.version += 1
            self.evictions[reason][group] += 1
        elif self.cached[group][key] != block:
            del others[block]  # a copy goes; the entry stays
            if not others:
                del copies[key]
        else:
            # The entry's block goes, a copy lives on: the key moves to it.
            self.cached[group][key] = others.popitem()[0]
            self.version += 1
            if not others:
                del copies[key]

    def reset_cache(self) -> int:
        dropped = 0
        key, tokens = self.key, self.tokens
        for g, table in enumerate(self.cached):
            for block in table.values():
                key[block] = None
                tokens[block] = None
            for others in self.copies[g].values():
                for block in others:
                    key[block] = None
                    tokens[block] = None
            dropped += len(table)
            self.evictions["reset"][g] += len(table)
            table.clear()
            self.copies[g].clear()
        self.version += 1
        return dropped

    @property
    def num_evictions(self) -> int:
        """Keys dropped to reuse their blocks or superseded (resets not counted)."""
        return sum(sum(self.evictions[r]) for r in ("lru", "probation", "superseded"))

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(t) for t in self.cached)

    # -- checks for tests --------------------------------------------------
    def check_invariants(self, held: dict[int, int]) -> None:
        """`held`: every block some request holds -> how many references the
        requests hold. Raises AssertionError on the first broken invariant:
        each page is free xor in exactly one held block, ref counts equal
        references, the key maps point only at blocks holding that key."""
        owner: dict[int, int] = {}

        def claim(block: int) -> None:
            for p in self.pages(block):
                assert p != NULL, f"block {block} uses the null page"
                assert p not in owner, f"page {p} is in blocks {owner[p]} and {block}"
                owner[p] = block

        free_pages = 0
        for block in self._free:
            assert self.ref[block] == 0, f"block {block} is in the free queue with references"
            assert block not in held, f"block {block} is free but a request holds it"
            claim(block)
            free_pages += self.width(block)
        free_pages += self.num_pages - self._next_fresh
        assert free_pages == self.num_free_pages, f"free page count {self.num_free_pages} != {free_pages}"
        for block, refs in held.items():
            assert block != NULL, "a request holds the null block as a block"
            assert self.ref[block] == refs, f"block {block} has ref count {self.ref[block]}, requests hold {refs}"
            claim(block)
        used = sum(self.width(b) for b in held)
        assert used + free_pages == self.num_pages - 1, (
            f"pages leaked: {used} held + {free_pages} free != {self.num_pages - 1}")
        keyed = 0
        for g, table in enumerate(self.cached):
            for key, block in table.items():
                assert self.key[block] == key and self.key_group[block] == g, (
                    f"cache map entry {key!r} points at block {block}, which holds another key")
                assert self.ref[block] > 0 or block in self._free, f"cached block {block} is neither held nor free"
            keyed += len(table)
            for key, others in self.copies[g].items():
                assert others and key in table, f"copies of key {key!r} without an entry in the map"
                for block in others:
                    assert block != table[key], f"block {block} is both the entry and a copy of {key!r}"
                    assert self.key[block] == key and self.key_group[block] == g, (
                        f"block {block} is listed as a copy of {key!r} but holds another key")
                    assert self.ref[block] > 0 or block in self._free, f"cached copy {block} is neither held nor free"
                keyed += len(others)
        assert keyed == sum(1 for k in self.key if k is not None), "a block holds a key no map lists"
