"""Full attention: query i reads every key j <= i, so a request keeps
every block, and a hit of n blocks needs all of blocks [0, n) cached."""

from __future__ import annotations

from functools import partial
from itertools import takewhile
from operator import is_not

from .base import AttentionManager

_is_cached = partial(is_not, None)


class FullAttentionManager(AttentionManager):
    kind = "full"

    def scan(self, req, limit):
        # Only the blocks before the first miss can serve a hit: the lookups
        # stop there (in C: takewhile over the map), which spares most of a
        # long prompt's lookups, each a few cache misses in a large pool.
        if self.verify:
            return super().scan(req, limit)
        found = list(takewhile(_is_cached, self.lookups(req.keys[:limit])))
        return found, b"\x01" * len(found) + (b"\x00" if len(found) < limit else b"")

    def longest_hit(self, mask, limit):
        # The first miss ends the hit.
        miss = mask.find(0, 0, limit)
        return limit if miss < 0 else miss
