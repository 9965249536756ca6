"""Full attention: query i reads every key j <= i, so a request keeps
every block, and a hit of n blocks needs all of blocks [0, n) cached."""

from __future__ import annotations

from .base import AttentionManager


class FullAttentionManager(AttentionManager):
    kind = "full"

    def longest_hit(self, req, limit):
        # Left to right; the first miss ends the hit.
        lookup = self._lookup
        for j in range(limit):
            if lookup(req, j) is None:
                return j
        return limit
