"""A prefix index a router can hold: which keys each source (a replica)
holds, per group, kept from the source's KV events (core/events.py), and
the hit a new request would get there, by the manager's own rule.

The hit is computed as the manager computes it: the request's chained keys
(the same hash, salt and extra keys), per group a mask of the positions
whose key the source holds, and the coordinator's fixed point over the
groups' own `longest_hit` (the same manager classes answer; they are made
over an empty block cache and only their rules are used). So for the same
events, `hit_tokens` equals `get_computed_tokens` of a fresh request on
that source's manager, for every layer mix.

Per group one dict, key -> a bitset of the sources holding it: a key held
by many replicas is stored once, and one lookup per position serves every
source at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat

from .block_cache import BlockCache
from .coordinator import _LOOKUP_ORDER, fixed_point
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
        self._order = sorted(self.managers, key=lambda m: _LOOKUP_ORDER[m.kind])
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

    def _hit(self, bit: int, holders: list[list[int]], limit: int) -> int:
        masks = [bytes(map(bool, map(bit.__and__, per_group))) for per_group in holders]
        return fixed_point(self._order, masks, limit) * self.block_size

    def _holders(self, keys: list) -> list[list[int]]:
        return [list(map(held.get, keys, repeat(0))) for held in self._held]

    def hit_tokens(self, source, token_ids: Sequence[int], cache_salt: str | None = None,
                   extra_keys: Sequence | None = None) -> int:
        """The prefix hit (tokens) a new request with these tokens would get
        on `source` now."""
        keys, limit = self.block_keys(token_ids, cache_salt, extra_keys)
        bit = self._bit.get(source)
        if bit is None or limit <= 0:
            return 0
        return self._hit(bit, self._holders(keys), limit)

    def best(self, token_ids: Sequence[int], cache_salt: str | None = None,
             extra_keys: Sequence | None = None) -> list[tuple[int, object]]:
        """Every source with a hit, as (hit tokens, source), longest first.
        The request's keys are hashed once and looked up once for all."""
        keys, limit = self.block_keys(token_ids, cache_salt, extra_keys)
        if limit <= 0:
            return []
        holders = self._holders(keys)
        anyone = 0
        for per_group in holders:
            for sources in per_group:
                anyone |= sources
        out = []
        for i, source in enumerate(self._sources):
            bit = 1 << i
            if anyone & bit:
                hit = self._hit(bit, holders, limit)
                if hit:
                    out.append((hit, source))
        out.sort(key=lambda pair: -pair[0])
        return out

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
