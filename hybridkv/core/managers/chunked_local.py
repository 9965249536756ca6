"""Chunked local attention C (Llama-4): query i reads keys j <= i with
j // C == i // C, so a request needs only the current chunk's blocks, and a
hit at a chunk boundary needs nothing at all. (The rule itself is
`ChunkedLocalSpec.first_visible`; the base class derives the releases.)"""

from __future__ import annotations

from .base import AttentionManager


class ChunkedLocalManager(AttentionManager):
    kind = "chunked_local"

    def longest_hit(self, req, limit):
        # For a candidate n, blocks [start(n), n) must be cached. A miss at j
        # rules out every candidate in (j, n] (they share n's chunk start or
        # an earlier one), so the next candidate is j itself.
        lookup = self._lookup
        n = limit
        while n > 0:
            for j in range(n - 1, self.hit_start(n) - 1, -1):
                if lookup(req, j) is None:
                    n = j
                    break
            else:
                return n
        return 0
