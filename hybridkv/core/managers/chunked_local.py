"""Chunked local attention C (Llama-4): query i reads keys j <= i with
j // C == i // C, so a request needs only the current chunk's blocks, and a
hit at a chunk boundary needs nothing at all. (The rule itself is
`ChunkedLocalSpec.first_visible`; the base class derives the releases.)"""

from __future__ import annotations

from .base import AttentionManager


class ChunkedLocalManager(AttentionManager):
    kind = "chunked_local"

    def longest_hit(self, mask, limit):
        # For a candidate n, blocks [start(n), n) must be cached. A miss at j
        # rules out every candidate in (j, n] (they share n's chunk start or
        # an earlier one), so the next candidate is j itself.
        n = limit
        while n > 0:
            miss = mask.rfind(0, self.hit_start(n), n)
            if miss < 0:
                return n
            n = miss
        return 0
