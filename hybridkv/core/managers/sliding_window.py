"""Sliding window W: query i reads keys i - W < j <= i, so after n tokens a
request needs only [n - (W - 1), n); blocks wholly before that are released
to the null block as soon as n passes them. A hit of n blocks needs the
blocks covering [n*bs - (W - 1), n*bs) cached, and nothing before. (The rule
itself is `SlidingWindowSpec.first_visible`; the base class derives the
releases from it.)"""

from __future__ import annotations

from .base import AttentionManager


class SlidingWindowManager(AttentionManager):
    kind = "sliding_window"

    def __init__(self, group, block_cache, caching, verify):
        super().__init__(group, block_cache, caching, verify)
        # Blocks a hit must hold: those covering the last W - 1 tokens.
        self.window_blocks = -(-(self.spec.sliding_window - 1) // self.block_size)

    def longest_hit(self, mask, limit):
        # Right to left: the first end whose `window_blocks` blocks before
        # it are all cached (or all blocks before it, near the start). Past
        # a miss, the next candidate end is just after the nearest cached
        # block before it (the block before an end must be cached).
        need = self.window_blocks
        if need == 0:
            return limit
        end = limit
        while end > 0:
            miss = mask.rfind(0, end - need if end > need else 0, end)
            if miss < 0:
                return end
            end = mask.rfind(1, 0, miss) + 1
        return 0
