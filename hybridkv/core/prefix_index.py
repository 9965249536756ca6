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
from itertools import accumulate, repeat
from operator import and_

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
        # A full-attention group first: where no source holds its block, the
        # other groups need not look further.
        self._full_first = sorted(self.managers, key=lambda m: m.kind != "full")
        # key -> per group, the bitset of the sources holding it there: one
        # lookup per position gives every group (the groups share the chain's
        # keys), and a key many sources hold is stored once.
        self._held: dict = {}
        self._nothing = (0,) * len(layout.groups)
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
        held = self._held
        groups = len(self._nothing)
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                g = event.group_idx
                for key in event.block_hashes:
                    entry = held.get(key)
                    if entry is None:
                        entry = held[key] = [0] * groups
                    entry[g] |= bit
            elif kind is BlockRemoved:
                g = event.group_idx
                keep = ~bit
                for key in event.block_hashes:
                    entry = held.get(key)
                    if entry is not None:
                        entry[g] &= keep
                        if not any(entry):
                            del held[key]
            elif kind is AllBlocksCleared:
                self._drop(bit)
            else:
                raise ValueError(f"not a KV event: {event!r}")

    def _drop(self, bit: int) -> None:
        """Every key of one source goes (O(keys): a reset is rare)."""
        keep = ~bit
        held = self._held
        for key, entry in list(held.items()):
            for g, sources in enumerate(entry):
                entry[g] = sources & keep
            if not any(entry):
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

    def _holders(self, keys: list) -> list:
        # One lookup per position, then per group its row (zip transposes in C).
        return list(zip(*map(self._held.get, keys, repeat(self._nothing)))) if keys else [() for _ in self._nothing]

    def _servable(self, holders: list, limit: int) -> list[int]:
        """Per hit length n = 1..limit (entry n - 1): the bitset of the
        sources where every group can serve a hit of n blocks, that is, holds
        every block of [hit_start(n), n) (the manager's rule: its fixed point
        over the groups' longest_hit is the longest such n). One pass over
        the positions per group for all sources at once (running ANDs in C
        where the window starts at block 0, a two-stack queue past that)."""
        servable = None
        for manager in self._full_first:
            row = holders[manager.index][:limit]
            if manager.recurrent:
                ok = row
            else:
                ok = self._window_and(row, manager, limit)
                if manager.kind == "full" and 0 in ok:  # no source serves a longer hit
                    limit = ok.index(0)
                    del ok[limit:]
            servable = ok if servable is None else list(map(and_, servable[:limit], ok[:limit]))
        return servable

    @staticmethod
    def _window_and(row, manager, limit: int) -> list[int]:
        """For every hit of m = 1..limit blocks: the AND of row[hit_start(m):m].
        Below, n is 0-based: starts[n] is the first block a hit of n + 1
        blocks needs."""
        if manager.kind == "full":
            return list(accumulate(row, and_))
        if manager.kind == "sliding_window":
            need = manager.window_blocks
            starts = range(1 - need, limit + 1 - need)  # hit_start(m) = max(0, m - need)
            n = min(need, limit)
        else:
            starts = [manager.hit_start(m) for m in range(1, limit + 1)]
            n = next((i for i, first in enumerate(starts) if first > 0), limit)
        out = list(accumulate(row[:n], and_))  # windows that start at block 0
        if n == limit:
            return out
        # Past that, a two-stack queue: the window's start only moves forward.
        front: list[int] = []  # ANDs of the window's oldest items, oldest on top
        back_items = list(row[:n])
        back = out[-1] if out else -1
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
            out.append((front[-1] if front else -1) & back)
        return out

    def _hits(self, keys: list, limit: int, among: int) -> list[tuple[int, int]]:
        """(hit tokens, source's bit) of each source in bitset `among` with
        a hit, longest first (ties: in the order the sources came)."""
        servable = self._servable(self._holders(keys), limit)
        hits = []
        bs = self.block_size
        for n in range(len(servable), 0, -1):
            new = servable[n - 1] & among
            if new:
                among ^= new
                while new:
                    low = new & -new
                    hits.append((n * bs, low))
                    new ^= low
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
        hits = self._hits(keys, limit, bit)
        return hits[0][0] if hits else 0

    def best(self, token_ids: Sequence[int], cache_salt: str | None = None,
             extra_keys: Sequence | None = None) -> list[tuple[int, object]]:
        """Every source with a hit, as (hit tokens, source), longest first.
        The request's keys are hashed once and looked up once for all."""
        return self.best_of_keys(self.block_keys(token_ids, cache_salt, extra_keys)[0])

    def best_of_keys(self, keys: list) -> list[tuple[int, object]]:
        """`best` for a request whose keys (`block_keys(...)[0]`) a caller
        has already: a router that also reads `held_tokens` then hashes the
        prompt once."""
        if not keys or not self._sources:
            return []
        sources = self._sources
        return [(hit, sources[bit.bit_length() - 1])
                for hit, bit in self._hits(keys, len(keys), (1 << len(sources)) - 1)]

    def held_tokens(self, keys: list) -> dict:
        """The token-prefix view: per source, the tokens of the request's
        leading blocks (`keys`, from block_keys) whose full-attention keys
        it holds, whatever its other layers hold; sources holding none are
        left out. What a router that treats every layer as full attention
        sees, and what RoutingRule's affinity credits. With no
        full-attention group the first group stands in."""
        runs: dict = {}
        alive = -1  # every source, until a block is missing there
        viewed, nothing, get = self._viewed_group, self._nothing, self._held.get
        sources = self._sources
        for position, key in enumerate(keys):
            now = alive & get(key, nothing)[viewed]
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
        """Distinct keys held, by any source in any group."""
        return len(self._held)
