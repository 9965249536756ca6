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

    def __init__(self, group, pool, caching, verify):
        super().__init__(group, pool, caching, verify)
        # Blocks a hit must hold: those covering the last W - 1 tokens.
        self.window_blocks = -(-(self.spec.sliding_window - 1) // self.block_size)

    def longest_hit(self, req, limit):
        # Right to left: the first run of `window_blocks` cached blocks (or a
        # run reaching block 0) ends at the longest valid hit.
        need = self.window_blocks
        if need == 0:
            return limit
        lookup = self._lookup
        end, run = limit, 0
        for j in range(limit - 1, -1, -1):
            if lookup(req, j) is None:
                end, run = j, 0
            else:
                run += 1
                if run == need:
                    return end
        return end
