"""The block cache: references, the LRU free queue and the cache keys.

Blocks are ints (core/page_allocator.py makes them of pages); their fields
live in per-page lists indexed by block id, so the hot paths create no
Python object per block (and the cyclic garbage collector has nothing to
scan). This is the one place where cache keys appear (`store`), move and
disappear (`evict`, `reset`): the managers read the per-group key maps and
never write them.

Free queue. One queue, least recently freed first. A block whose reference
count drops to 0 keeps its cached content and goes to the tail; a block
with nothing cached, or released on probation, goes to the head (keeping it
gains nothing, or little). New blocks come from the allocator's spare pages
first, then from the queue's head (`_reclaim`): a block taken from the
queue loses its key. Every operation is O(1) per block it touches.

Copies of one content. Two requests that compute the same block before
either finds the other's hold two blocks with one key. The first is the
key's entry in the map; the others are remembered as its copies, so that
when the entry's block is evicted while a copy lives on, the key moves to
the copy and the content stays findable (a dict per key: O(1) to add, drop
or promote one).

Why keys leave the map is counted per group: `lru` (a free cached block
taken for new content), `probation` (the same, for a checkpoint released on
probation), `superseded` (dropped by its owner: an older rolling Mamba
checkpoint), `reset` (`reset`) and `lost` (a block whose load from a tier
failed: it never held its content).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter, not_

from .page_allocator import NULL, PageAllocator

EVICTION_REASONS = ("lru", "probation", "superseded", "reset", "lost")
# Keys that leave for these reasons go to the tier below, if there is one:
# the block is being reused, its content is still worth something. A
# superseded checkpoint is not (its owner has a newer one).
_SPILLED = ("lru", "probation")
# From this many blocks on, `store` first tries to add them all in one dict
# update (a prefill's blocks, nearly always new content); below it, the
# checks that the shortcut needs cost more than the per-block loop.
_BULK_STORE = 8
# A block released on probation keeps its place in LRU order until this
# fraction of the pool's pages has been released after it (see BlockCache).
PROBATION_GRACE_FRACTION = 8


class BlockCache:
    def __init__(self, num_pages: int, num_groups: int):
        self.allocator = PageAllocator(num_pages)
        self.num_pages = num_pages
        self.ref = [0] * num_pages  # per block id: references held by requests
        self.key: list = [None] * num_pages  # per block id: its cache key while cached
        self.key_group = [0] * num_pages  # per block id: the group whose map holds the key
        self.tokens: list = [None] * num_pages  # per block id: token ids, only when the hash is not trusted
        self._tokens_kept = False  # has any block had token ids (an untrusted hash)?
        # The free queue: block -> released on probation. (The flag rides
        # in the queue because popping a block returns its entry anyway.)
        self._free: OrderedDict[int, bool] = OrderedDict()
        self._free_pages = 0  # pages of the blocks in the queue
        # Probation waits out a grace first: a block released on probation
        # stays in LRU order until `probation_grace` more pages have been
        # released after it, then goes before any other (`_probation`:
        # (block, pages released when it was) in release order, checked
        # against `_probation_stamp` since a block may be taken and released
        # again meanwhile). A prompt sent again soon after (a regenerated
        # answer, a retry) still finds its state; under pressure the state
        # goes first, as a chat's next turn resumes elsewhere.
        self.probation_grace = num_pages // PROBATION_GRACE_FRACTION
        self._released_pages = 0
        self._probation: deque[tuple[int, int]] = deque()
        self._probation_stamp: dict[int, int] = {}
        self.cached: list[dict] = [{} for _ in range(num_groups)]  # per group: key -> block
        # Per group, key -> {block: None}: other blocks holding the content of
        # the block that the map names (see "Copies of one content").
        self.copies: list[dict] = [{} for _ in range(num_groups)]
        # Bumped whenever a cache key appears, disappears or moves, so a
        # remembered prefix hit can tell that it may be stale.
        self.version = 0
        self.evictions = {reason: [0] * num_groups for reason in EVICTION_REASONS}
        # A tier below the pool (core/tiers.py): `spill(group, key, block)`
        # keeps the content of a block about to be reused. None: no tier.
        self.spill = None
        # KV events (core/events.py): None when off, else a list of
        # ("stored", group, keys, parent, tokens), ("removed", group, key)
        # and ("cleared",) in order, for KVCacheManager.take_events.
        self.events: list | None = None

    @property
    def num_free_pages(self) -> int:
        """Pages no request holds (spare, or in free blocks); the null page not counted."""
        return self.allocator.num_spare_pages + self._free_pages

    def pages(self, block: int, width: int = 1):
        return self.allocator.pages(block, width)

    def width(self, block: int) -> int:
        return self.allocator.widths[block]

    # -- references ----------------------------------------------------------
    def allocate(self, needs: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Per (width, count) in `needs`, `count` new blocks of `width`
        pages, one reference each. One call per step or admission: blocks
        taken from the queue go to a group of their own width while one
        still wants some, and only the rest are taken apart. The caller has
        checked `num_free_pages` (`_reclaim` raises RuntimeError, before
        any change, where the free queue is short)."""
        out = self.allocator.take(needs, self._reclaim)
        ref = self.ref
        for blocks in out:
            for block in blocks:
                ref[block] = 1
        return out

    def _reclaim(self, pages: int, want: dict[int, int], reused: dict[int, list[int]]) -> list[int]:
        """Blocks from the queue's head, at least `pages` pages in all, each
        losing its key (evicted) if it had one, sorted for the allocator
        (PageAllocator.take): one whose width `want` still counts goes to
        `reused[width]` and is counted off; the others, in order, are
        returned. Blocks on probation whose grace is over go first (the
        pages released do not change while blocks are taken, so once none
        is left none becomes so)."""
        if pages > self._free_pages:
            raise RuntimeError(f"allocate: {pages} pages more asked than the spare ones, "
                               f"{self._free_pages} free in the queue (caller must check)")
        free, widths, key_of = self._free, self.allocator.widths, self.key
        out = []
        keyed = []  # blocks whose keys go for "lru" after the loop
        on_probation = []  # ... and for "probation"
        if self._probation:  # (empty without recurrent groups)
            # They go to the queue's head, in the order found, so the loop
            # below takes them first (each still flagged as on probation).
            expired, found = [], 0
            while found < pages:
                block = self._expired_probation()
                if block is None:
                    break
                expired.append(block)
                found += widths[block]
            for block in reversed(expired):
                free.move_to_end(block, last=False)
        got = 0
        # Without a tier or events, the usual eviction (one block per key)
        # happens here, block by block as the queue gives them up: nothing
        # observes the order of the keys that leave. Otherwise `evict` does
        # it after the loop, in the queue's order. (The keys that leave are
        # counted from the maps' sizes: a copy's key stays in its map.)
        inline = self.spill is None and self.events is None
        popitem, key_group, cached, copies = free.popitem, self.key_group, self.cached, self.copies
        sizes = [len(m) for m in cached]
        dropped = False
        while got < pages:
            block, probation = popitem(False)
            key = key_of[block]
            if key is not None:
                if probation:
                    on_probation.append(block)
                elif inline:
                    group = key_group[block]
                    key_of[block] = None
                    if copies[group] and key in copies[group]:
                        self._drop_copy(group, key, block)
                    else:
                        del cached[group][key]
                    dropped = True
                else:
                    keyed.append(block)
            width = widths[block]
            got += width
            left = want.get(width)
            if left:
                want[width] = left - 1
                reused[width].append(block)
            else:
                out.append(block)
        self._free_pages -= got
        if dropped:
            counts = self.evictions["lru"]
            for group, size in enumerate(sizes):
                counts[group] += size - len(cached[group])
            if self._tokens_kept:
                tokens = self.tokens
                for blocks in (out, *reused.values()):
                    for block in blocks:
                        tokens[block] = None
            self.version += 1
        if keyed:
            self.evict(keyed, "lru")
        if on_probation:
            self.evict(on_probation, "probation")
        return out

    def _expired_probation(self) -> int | None:
        """The oldest block on probation whose grace is over and that still
        waits, on probation, in the free queue (None: none)."""
        queue, stamp, free = self._probation, self._probation_stamp, self._free
        while queue and self._released_pages - queue[0][1] >= self.probation_grace:
            block, released = queue.popleft()
            if stamp.get(block) == released:
                del stamp[block]
                if free.get(block) is True:
                    return block
        return None

    def touch(self, block: int) -> None:
        """One more reference (a prefix hit or a fork)."""
        ref = self.ref
        if ref[block] == 0:
            del self._free[block]
            self._free_pages -= self.allocator.widths[block]
        ref[block] += 1

    def touch_all(self, table: Sequence[int]) -> None:
        """`touch` every non-null block of a block table. A block another
        request holds, the usual case for a shared prefix, only counts one
        more reference."""
        ref, free, widths = self.ref, self._free, self.allocator.widths
        if self._all_held(table):  # the loop only counts
            for block in table:
                ref[block] += 1
            return
        for block in table:
            if block:
                if ref[block]:
                    ref[block] += 1
                else:
                    del free[block]
                    self._free_pages -= widths[block]
                    ref[block] = 1

    def free_pages_in(self, table: Sequence[int]) -> int:
        """Pages of the table's blocks that wait in the free queue: what
        touching them all takes from `num_free_pages`."""
        if self._all_held(table):
            return 0
        # In C: the blocks whose count is 0, less the null block's entries.
        refs = map(self.ref.__getitem__, table)
        return sum(map(self.allocator.widths.__getitem__, filter(None, compress(table, map(not_, refs)))))

    def _all_held(self, table: Sequence[int]) -> bool:
        """Is every entry a block some request holds? (In C: a shared
        prefix, the usual hit, is held by the requests running on it.)"""
        return len(table) > 1 and NULL not in table and 0 not in itemgetter(*table)(self.ref)

    def release(self, block: int, probation: bool = False) -> None:
        """One reference less. `probation`: the block stays cached, and once
        its grace is over (see __init__) it is the first to go if memory
        runs short (a checkpoint unlikely to be reused but soon)."""
        ref = self.ref
        ref[block] -= 1
        if ref[block] == 0:
            self._free[block] = probation
            width = self.allocator.widths[block]
            self._free_pages += width
            self._released_pages += width
            if self.key[block] is None:
                self._free.move_to_end(block, last=False)
            elif probation:
                self._probation.append((block, self._released_pages))
                self._probation_stamp[block] = self._released_pages

    def release_all(self, blocks: Sequence[int]) -> None:
        """`release` each non-null block of `blocks`, in that order, none on
        probation (a request's table, its last block first: see `free`)."""
        ref, free, key_of, widths = self.ref, self._free, self.key, self.allocator.widths
        pages = 0
        for block in blocks:
            if block:
                count = ref[block] - 1
                ref[block] = count
                if not count:
                    free[block] = False
                    pages += widths[block]
                    if key_of[block] is None:
                        free.move_to_end(block, last=False)
        # (Summed once: no block released here is stamped with the count.)
        self._free_pages += pages
        self._released_pages += pages

    # -- keys ------------------------------------------------------------------
    def store(self, group: int, blocks: Sequence[int], keys: Sequence, tokens: Sequence | None = None,
              keep_copies: bool = False, parent=None, token_ids: Sequence[int] | None = None) -> int:
        """Register computed blocks under their keys in `group`'s map
        (null blocks and blocks that hold a key already are skipped).
        `tokens`: per block, its token ids, kept when the hash is not
        trusted. Where another block holds a key already, that one stays
        the entry, and with `keep_copies` the new block is remembered as a
        copy of it (an attention block other requests may keep reading; a
        Mamba state moves on, so it is not kept). Returns how many blocks
        became entries. For events only: `parent`, the key before `keys[0]`
        in its chain, and `token_ids`, the tokens of the blocks of `keys`
        one after the other (block_size each)."""
        cached, key_of, key_group = self.cached[group], self.key, self.key_group
        if len(blocks) == 1 and tokens is None and self.events is None:
            # A decode step's one full block: as the loop below does for it.
            block, key = blocks[0], keys[0]
            if not block or key_of[block] is not None:
                return 0
            if key not in cached:
                cached[key] = block
                entries = 1
            elif keep_copies:
                self.copies[group].setdefault(key, {})[block] = None
                entries = 0
            else:
                return 0
            key_of[block] = key
            key_group[block] = group
            self.version += entries
            return entries
        if (tokens is None and len(blocks) >= _BULK_STORE and NULL not in blocks
                and not any(itemgetter(*blocks)(key_of))):
            # One pass over the map, in C: setdefault leaves a key that is
            # there already as it was, and answers the block holding it.
            holders = list(map(cached.setdefault, keys, blocks))
            for block, key in zip(blocks, keys):
                key_of[block] = key
                key_group[block] = group
            if holders == blocks:  # the usual case: every key is new
                self.version += 1
                if self.events is not None:
                    self.events.append(("stored", group, list(keys), parent, list(token_ids or ())))
                return len(blocks)
            added = []  # indices of the blocks that became entries
            for i, (block, holder) in enumerate(zip(blocks, holders)):
                if holder == block:
                    added.append(i)
                elif keep_copies:
                    self.copies[group].setdefault(keys[i], {})[block] = None
                else:
                    key_of[block] = None
            if added:
                self.version += 1
                if self.events is not None:
                    self._stored_runs(group, keys, added, parent, token_ids)
            return len(added)
        entries = 0
        added = [] if self.events is not None else None  # (index, key) of new entries, for events
        for i, block in enumerate(blocks):
            if not block or key_of[block] is not None:
                continue
            key = keys[i]
            own = tokens[i] if tokens is not None else None
            if key not in cached:
                cached[key] = block
                entries += 1
                if added is not None:
                    added.append(i)
            elif keep_copies and (own is None or self.tokens[cached[key]] == own):
                # (With an untrusted hash, equal keys may hold other
                # tokens: a collision is not a copy.)
                self.copies[group].setdefault(key, {})[block] = None
            else:
                continue
            key_of[block] = key
            key_group[block] = group
            if own is not None:
                self.tokens[block] = own
                self._tokens_kept = True
        if entries:
            self.version += 1
            if added:
                self._stored_runs(group, keys, added, parent, token_ids)
        return entries

    def _stored_runs(self, group: int, keys: Sequence, added: list[int], parent, token_ids) -> None:
        """Events for the new entries among `keys` (their indices, in
        order): one per run of consecutive ones, each with its parent and
        its blocks' tokens."""
        start = 0
        size = len(token_ids) // len(keys) if token_ids else 0  # tokens per block
        for n in range(1, len(added) + 1):
            if n == len(added) or added[n] != added[n - 1] + 1:
                first, last = added[start], added[n - 1]
                run_parent = keys[first - 1] if first else parent
                run_tokens = list(token_ids[first * size:(last + 1) * size]) if size else []
                self.events.append(("stored", group, list(keys[first:last + 1]), run_parent, run_tokens))
                start = n

    def evict(self, blocks: Sequence[int], reason: str) -> None:
        """The blocks' contents are no longer findable by their keys (a free
        block that stays in the queue moves to its head: it holds nothing
        worth keeping). Where a copy of a content lives on, its key moves
        to the copy. Blocks without a key are left as they are."""
        key_of, key_group, tokens, ref, free = self.key, self.key_group, self.tokens, self.ref, self._free
        counts = self.evictions[reason]
        spill = self.spill if reason in _SPILLED else None
        events = self.events
        for block in blocks:
            key = key_of[block]
            if key is None:
                continue
            group = key_group[block]
            key_of[block] = None
            if tokens[block] is not None:
                tokens[block] = None
            copies = self.copies[group]
            if not (copies and key in copies):  # the usual case: one block per key
                if spill is not None:
                    spill(group, key, block)
                del self.cached[group][key]
                counts[group] += 1
                if events is not None:
                    events.append(("removed", group, key))
            else:
                self._drop_copy(group, key, block)
            if not ref[block] and block in free:
                free.move_to_end(block, last=False)
        self.version += 1

    def _drop_copy(self, group: int, key, block: int) -> None:
        """`block` no longer holds `key`, which other blocks hold too: a copy
        goes and the entry stays, or the entry goes and the key moves to a
        copy. The content stays findable: nothing is counted or reported."""
        copies = self.copies[group]
        others = copies[key]
        if self.cached[group][key] != block:
            del others[block]
        else:
            self.cached[group][key] = others.popitem()[0]
        if not others:
            del copies[key]

    def reset(self) -> int:
        """Forget every key (blocks in use stay with their requests).
        Returns the number of keys dropped."""
        dropped = 0
        key, tokens = self.key, self.tokens
        for g, table in enumerate(self.cached):
            for others in (table.values(), *self.copies[g].values()):
                for block in others:
                    key[block] = None
                    tokens[block] = None
            dropped += len(table)
            self.evictions["reset"][g] += len(table)
            table.clear()
            self.copies[g].clear()
        self.version += 1
        if self.events is not None:
            self.events.append(("cleared",))
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
        each page is spare, in a free block or in a held block, exactly
        once; ref counts equal references; the key maps point only at
        blocks holding that key."""
        owner: dict[int, int] = {}

        def claim(page: int, block: int) -> None:
            assert page != NULL, f"block {block} uses the null page"
            assert page not in owner, f"page {page} is in blocks {owner[page]} and {block}"
            owner[page] = block

        free_pages = 0
        for block in self._free:
            assert self.ref[block] == 0, f"block {block} is in the free queue with references"
            assert block not in held, f"block {block} is free but a request holds it"
            for page in self.pages(block):
                claim(page, block)
            free_pages += self.width(block)
        assert free_pages == self._free_pages, f"free queue page count {self._free_pages} != {free_pages}"
        free_pages += self.allocator.check_invariants(claim)
        for block, refs in held.items():
            assert block != NULL, "a request holds the null block as a block"
            assert self.ref[block] == refs, f"block {block} has ref count {self.ref[block]}, requests hold {refs}"
            for page in self.pages(block):
                claim(page, block)
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
