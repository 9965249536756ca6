"""The page allocator: which pages hold no block, and how blocks of any
width are made of them.

The pool is `num_pages` pages of one size (core/layout.py); page 0 is the
null page and is never handed out. A block is what a group allocates:
`width` pages (`KVCacheGroup.pages_per_block`), named by its block id, the
id of its first page. Every page can serve every group, so no group starves
while another holds idle memory.

The allocator knows nothing of cache keys or references. It hands out
blocks cut from its spare pages (never used, or left over when a block of
another width was taken apart) and, when those run short, asks the block
cache (`reclaim`) for free blocks to reuse: a reclaimed block of a width
still wanted is reused whole, any other is taken apart into spare pages.

Pages are handled as runs (ranges). A block's width and, when its pages are
not one run from its first page (it was put together from pieces), its runs
live in per-page lists indexed by block id; the entries of a block's other
pages mean nothing. So cutting blocks out of a run, or taking a wide one
apart, is a few slice operations in C however wide the blocks are, and no
Python object is made per block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import chain

NULL = 0  # the null page, and the null block: a placeholder in tables, never allocated


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs the null page and at least one more, got {num_pages} pages")
        self.num_pages = num_pages
        self.widths = [1] * num_pages  # per block id: pages in the block
        self.runs: list = [None] * num_pages  # per block id: its runs, when not one run
        # Spare pages as runs, used from the left. Never-used pages come
        # first; the pages of blocks taken apart join at the right.
        self._spare: deque[range] = deque([range(1, num_pages)])
        self.num_spare_pages = num_pages - 1

    def pages(self, block: int, width: int = 1):
        """The pages of a block, in order (the null block's: `width` null pages)."""
        if block == NULL:
            return (NULL,) * width
        runs = self.runs[block]
        return range(block, block + self.widths[block]) if runs is None else tuple(chain.from_iterable(runs))

    def width(self, block: int) -> int:
        return self.widths[block]

    def take(self, needs: Sequence[tuple[int, int]], reclaim: Callable[[int, dict, dict], list[int]]) -> list[list[int]]:
        """Per (width, count) in `needs`, `count` new blocks of `width`
        pages (groups of one width get consecutive pieces of one list).
        `reclaim(pages, want, reused)` takes free blocks of at least that
        many pages in all, and sorts them as it goes by the rule below:
        each of a width `want` (width -> count) still counts goes to
        `reused[width]` and is counted off `want`; the others are returned,
        in order. It is called at most once, for what the spare pages lack.
        The caller has checked that enough pages are free."""
        need = 0
        for width, count in needs:
            need += width * count
        if need <= self.num_spare_pages:  # (a step's new blocks, while spare pages last)
            return [self._cut(width, count) for width, count in needs]
        want: dict[int, int] = {}
        for width, count in needs:
            if count:
                want[width] = want.get(width, 0) + count
        reused: dict[int, list[int]] = {width: [] for width in want}
        # A reclaimed block goes whole to a width still wanted (`reclaim`
        # sorts them as it takes them: one pass per block); any other is
        # taken apart into spare pages.
        widths, runs, spare = self.widths, self.runs, self._spare
        for block in reclaim(need - self.num_spare_pages, want, reused):
            width = widths[block]
            if runs[block] is None:
                # Joined to the last spare run where adjacent (a request's
                # blocks leave the queue together, last first): a wide
                # block cut from the spare pages then has fewer pieces.
                last = spare[-1] if spare else None
                if last is not None and last.start == block + width:
                    spare[-1] = range(block, last.stop)
                elif last is not None and last.stop == block:
                    spare[-1] = range(last.start, block + width)
                else:
                    spare.append(range(block, block + width))
            else:
                spare.extend(runs[block])
                runs[block] = None
            self.num_spare_pages += width
        # (`want` now counts what the reused blocks did not cover.)
        got = {width: self._cut(width, count) + reused[width] if count else reused[width]
               for width, count in want.items()}
        if len(got) == len(needs):  # (each width asked for once)
            return [got[width] if count else [] for width, count in needs]
        out = []
        taken: dict[int, int] = {}
        for width, count in needs:
            at = taken.get(width, 0)
            out.append(got[width][at:at + count] if count else [])  # (a width asked for no block may be missing from got)
            taken[width] = at + count
        return out

    def _cut(self, width: int, count: int) -> list[int]:
        """`count` blocks of `width` pages from the left of the spare runs.
        A block inside a run is a run; one that straddles runs is pieced."""
        out: list[int] = []
        if not count:
            return out
        spare, widths = self._spare, self.widths
        if count == 1 and len(spare[0]) >= width:  # (a step's one new block, inside the first run)
            run = spare[0]
            block = run.start
            if len(run) == width:
                spare.popleft()
            else:
                spare[0] = run[width:]
            widths[block] = width
            self.num_spare_pages -= width
            out.append(block)
            return out
        self.num_spare_pages -= width * count
        pieces: list[range] = []  # runs of a block begun in an earlier run
        pieced = 0
        while count:
            run = spare.popleft()
            if pieces:
                rest = width - pieced
                pieces.append(run[:rest])
                if len(run) < rest:
                    pieced += len(run)
                    continue
                out.append(self._pieced_block(pieces, width))
                count -= 1
                pieces, pieced = [], 0
                run = run[rest:]
            whole = min(count, len(run) // width)
            if whole == 1:  # (a step's one new block: a plain store)
                widths[run.start] = width
                out.append(run.start)
            elif whole:
                stop = run.start + whole * width
                widths[run.start:stop:width] = [width] * whole
                out.extend(range(run.start, stop, width))
            count -= whole
            run = run[whole * width:]
            if run:
                if count:
                    pieces, pieced = [run], len(run)
                else:
                    spare.appendleft(run)
        return out

    def _pieced_block(self, pieces: list[range], width: int) -> int:
        """A block of the runs `pieces`, adjacent ones joined."""
        joined = [pieces[0]]
        for run in pieces[1:]:
            if joined[-1].stop == run.start:
                joined[-1] = range(joined[-1].start, run.stop)
            else:
                joined.append(run)
        first = joined[0].start
        self.widths[first] = width
        if len(joined) > 1:
            self.runs[first] = tuple(joined)
        return first

    def check_invariants(self, claim: Callable[[int, int], None]) -> int:
        """Claim every spare page (`claim(page, NULL)`); returns their count."""
        count = 0
        for run in self._spare:
            for page in run:
                claim(page, NULL)
            count += len(run)
        assert count == self.num_spare_pages, f"spare page count {self.num_spare_pages} != {count}"
        return count
