"""A prefix index a router can hold: which keys each source (a replica)
holds, per group, kept from the source's KV events (core/events.py), and
the hit a new request would get there, by the manager's own rule.

The hit is the manager's: the request's chained keys (the same hash, salt
and extra keys), and the longest n such that every group holds every block
a hit of n blocks needs there, [hit_start(n), n) by the group's own manager
(the same manager classes answer `hit_start`; they are made over an empty
block cache and only their rules are used). That n is what the manager's
fixed point over the groups' `longest_hit` finds, so for the same events
`hit_tokens` equals `get_computed_tokens` of a fresh request on that
source's manager, for every layer mix.

Per group one dict, key -> a bitset of the sources holding it: a key held
by many replicas is stored once, one lookup per position serves every
source at once, and the rule runs on the bitsets, for all sources in one
pass over the positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from .block_cache import BlockCache
from .events import AllBlocksCleared, BlockRemoved, BlockStored
from .hashing import BlockHasher
from .layout import KVCacheLayout
from .managers import make_manager


class PrefixIndex:
    def __init__(self, layout: KVCacheLayout, hash_function="sha256"):
        self.layout = layout
        self.block_size = layout.block_size
        self.hasher = BlockHasher(hash_function)
        rules = BlockCache(2, len(layout.groups))
        self.managers = [make_manager(g, rules, True, False, None) for g in layout.groups]
        self._held: list[dict] = [{} for _ in layout.groups]  # per group: key -> bitset of sources
        self._bit: dict = {}  # source -> its bit
        self._sources: list = []  # bit index -> source
        full = [g for g, group in enumerate(layout.groups) if group.kind == "full"]
        self._viewed_group = full[0] if full else 0

    def _source_bit(self, source) -> int:
        bit = self._bit.get(source)
        if bit is None:
            bit = self._bit[source] = 1 << len(self._sources)
            self._sources.append(source)
        return bit

    @property
    def sources(self) -> list:
        return list(self._sources)

    def apply(self, source, events: Iterable) -> None:
        """Apply `source`'s events, in the order it reported them."""
        bit = self._source_bit(source)
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                held = self._held[event.group_idx]
                for key in event.block_hashes:
                    held[key] = held.get(key, 0) | bit
            elif kind is BlockRemoved:
                held = self._held[event.group_idx]
                for key in event.block_hashes:
                    rest = held.get(key, 0) & ~bit
                    if rest:
                        held[key] = rest
                    else:
                        held.pop(key, None)
            elif kind is AllBlocksCleared:
                self._drop(bit)
            else:
                raise ValueError(f"not a KV event: {event!r}")

    def _drop(self, bit: int) -> None:
        """Every key of one source goes (O(keys): a reset is rare)."""
        for held in self._held:
            for key, sources in list(held.items()):
                rest = sources & ~bit
                if rest:
                    held[key] = rest
                else:
                    del held[key]

    def remove_source(self, source) -> None:
        """A source went away: forget what it held (its bit is kept unused)."""
        bit = self._bit.get(source)
        if bit is not None:
            self._drop(bit)

    def block_keys(self, token_ids: Sequence[int], cache_salt=None, extra_keys=None) -> tuple[list, int]:
        """The chained keys of the whole blocks a hit could cover, and their count."""
        limit = (len(token_ids) - 1) // self.block_size  # whole blocks, one token left to compute
        keys: list = []
        if limit > 0:
            self.hasher.extend(keys, self.hasher.root(cache_salt, extra_keys), list(token_ids), self.block_size,
                               limit)
        return keys, limit

    def _holders(self, keys: list) -> list[list[int]]:
        return [list(map(held.get, keys, repeat(0))) for held in self._held]

    def _servable(self, holders: list[list[int]], limit: int) -> list[int]:
        """Per hit length n = 1..limit (entry n - 1): the bitset of the
        sources where every group can serve a hit of n blocks, that is, holds
        every block of [hit_start(n), n) (the manager's rule: its fixed point
        over the groups' longest_hit is the longest such n). One pass over
        the positions per group for all sources at once, a window's AND kept
        by a two-stack queue (the window's start only moves forward)."""
        servable = [-1] * limit
        for manager in self.managers:
            row = holders[manager.index]
            kind = manager.kind
            if kind == "full":
                run = -1
                for n in range(limit):
                    run &= row[n]
                    if not run:  # no source serves n + 1 blocks or more
                        del servable[n:]
                        limit = n
                        break
                    servable[n] &= run
            elif kind == "mamba":
                for n in range(limit):
                    servable[n] &= row[n]
            else:
                self._window_and(row, manager, limit, servable)
        return servable

    @staticmethod
    def _window_and(row: list[int], manager, limit: int, servable: list[int]) -> None:
        """For every hit of m = 1..limit blocks: servable[m - 1] &= the AND
        of row[hit_start(m):m]. Below, n is 0-based: starts[n] is the first
        block a hit of n + 1 blocks needs."""
        if manager.kind == "sliding_window":
            need = manager.window_blocks
            starts = range(1 - need, limit + 1 - need)  # hit_start(m) = max(0, m - need)
        else:
            starts = [manager.hit_start(n) for n in range(1, limit + 1)]
        n = 0
        run = -1
        while n < limit and starts[n] <= 0:  # windows that start at block 0: a running AND
            run &= row[n]
            servable[n] &= run
            n += 1
        if n == limit:
            return
        # Past that, a two-stack queue: the window's start only moves forward.
        front: list[int] = []  # ANDs of the window's oldest items, oldest on top
        back_items = row[:n]
        back = run
        start = 0
        for n in range(n, limit):
            item = row[n]
            back &= item
            back_items.append(item)
            first = starts[n]
            while start < first:  # pop the oldest item
                if not front:
                    acc = -1
                    for old in reversed(back_items):
                        acc &= old
                        front.append(acc)
                    back_items.clear()
                    back = -1
                front.pop()
                start += 1
            servable[n] &= (front[-1] if front else -1) & back

    def _hits(self, keys: list, limit: int, among: int) -> dict:
        """Bit -> the hit (blocks) of each source in bitset `among` with one."""
        servable = self._servable(self._holders(keys), limit)
        hits = {}
        for n in range(len(servable), 0, -1):  # the longest first
            new = servable[n - 1] & among
            while new:
                low = new & -new
                hits[low] = n
                new ^= low
                among &= ~low
            if not among:
                break
        return hits

    def hit_tokens(self, source, token_ids: Sequence[int], cache_salt: str | None = None,
                   extra_keys: Sequence | None = None) -> int:
        """The prefix hit (tokens) a new request with these tokens would get
        on `source` now."""
        keys, limit = self.block_keys(token_ids, cache_salt, extra_keys)
        bit = self._bit.get(source)
        if bit is None or limit <= 0:
            return 0
        return self._hits(keys, limit, bit).get(bit, 0) * self.block_size

    def best(self, token_ids: Sequence[int], cache_salt: str | None = None,
             extra_keys: Sequence | None = None) -> list[tuple[int, object]]:
        """Every source with a hit, as (hit tokens, source), longest first.
        The request's keys are hashed once and looked up once for all."""
        keys, limit = self.block_keys(token_ids, cache_salt, extra_keys)
        if limit <= 0 or not self._sources:
            return []
        hits = self._hits(keys, limit, (1 << len(self._sources)) - 1)
        sources = self._sources
        return sorted(((n * self.block_size, sources[bit.bit_length() - 1]) for bit, n in hits.items()),
                      key=lambda pair: -pair[0])

    def held_tokens(self, keys: list) -> dict:
        """The token-prefix view: per source, the tokens of the request's
        leading blocks (`keys`, from block_keys) whose full-attention keys
        it holds, whatever its other layers hold; sources holding none are
        left out. What a router that treats every layer as full attention
        sees, and what RoutingRule's affinity credits. With no
        full-attention group the first group stands in."""
        runs: dict = {}
        alive = -1  # every source, until a block is missing there
        get = self._held[self._viewed_group].get
        sources = self._sources
        for position, key in enumerate(keys):
            now = alive & get(key, 0)
            gone = alive & ~now if position else 0
            while gone:
                low = gone & -gone
                runs[sources[low.bit_length() - 1]] = position * self.block_size
                gone ^= low
            alive = now
            if not alive:
                return runs
        while alive > 0:
            low = alive & -alive
            runs[sources[low.bit_length() - 1]] = len(keys) * self.block_size
            alive ^= low
        return runs

    @property
    def num_keys(self) -> int:
        return sum(len(held) for held in self._held)
