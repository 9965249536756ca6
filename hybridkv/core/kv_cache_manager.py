"""KVCacheManager: the face a scheduler sees.

It checks every input at the boundary (a clear ValueError, nothing changed),
keeps the request records, and hands the work to the coordinator. See
docs/api.md for the contract and an example scheduler loop.
"""

from __future__ import annotations

import struct
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .block_cache import EVICTION_REASONS
from .checkpoints import CheckpointPolicy, get_policy
from .coordinator import make_coordinator
from .events import AllBlocksCleared, BlockRemoved, BlockStored
from .hashing import BlockHasher, token_bytes_of
from .layout import KVCacheLayout
from .request import NO_FAST_PATH, CacheRequest, HitMemo


class UnknownRequestError(ValueError, KeyError):
    """An id the manager does not hold (a ValueError, and a KeyError for
    code that treats the manager as a mapping)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class CacheStats:
    requests: int  # requests that took their first allocation
    queried_tokens: int  # prompt tokens of those requests
    hit_tokens: int  # of which served from the prefix cache
    cached_blocks: int  # blocks now findable by key (free or in use)
    evictions: int  # cache keys dropped to reuse their blocks
    free_pages: int
    total_pages: int  # usable pages (the null page excluded)
    # per group: pages released mid-request because no query reads them again
    # (left a sliding window or a finished local chunk)
    released_pages: tuple[int, ...] = ()
    group_kinds: tuple[str, ...] = ()  # per group: "full", "sliding_window", ...
    # per group: prompt tokens the joint hit would have had on top, summed
    # over admissions, had this group alone served more (explain_hit)
    capped_tokens: tuple[int, ...] = ()
    # reason ("lru", "probation", "superseded", "reset", "lost") -> per group, cache
    # keys dropped for it (core/block_cache.py)
    evictions_by_reason: dict = None
    # tier ("host", "disk") -> per group, hit blocks loaded from it into the pool
    tier_loads: dict = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def usage(self) -> float:
        return 1.0 - self.free_pages / self.total_pages


@dataclass(frozen=True)
class GroupHit:
    """One group's part in a request's prefix hit (tokens)."""
    group: int
    kind: str
    alone_tokens: int  # the longest hit this group alone could serve
    without_tokens: int  # the joint hit if this group could serve anything
    capped_tokens: int  # without_tokens - the joint hit: what this group alone cost
    # alone_tokens == the joint hit < the limit: this group has nothing
    # longer (when several do, none capped the hit on its own)
    limits: bool

    @property
    def capped(self) -> bool:
        return self.capped_tokens > 0


@dataclass(frozen=True)
class HitExplanation:
    """Why a request's prefix hit is as long as it is (kv.explain_hit)."""
    request_id: str
    prompt_tokens: int  # tokens known at the lookup
    hit_tokens: int  # the joint hit: what every group can serve
    limit_tokens: int  # the longest hit possible: whole blocks, one token left to compute
    # prompt_tokens - limit_tokens, split in two: the tail past the last whole
    # block (never cacheable), and the last whole block when the prompt ends
    # on a block boundary (a hit leaves at least one token to compute)
    lost_to_block_rounding: int
    lost_to_one_token_minimum: int
    groups: tuple[GroupHit, ...]
    caching: bool = True
    # tier -> per group, blocks of the hit loaded from it (the rest came from
    # the pool); known once the request took its hit
    loaded_blocks: dict | None = None

    @property
    def missed_tokens(self) -> int:
        """Tokens a hit could have covered but the cache did not serve."""
        return self.limit_tokens - self.hit_tokens

    @property
    def capping_groups(self) -> tuple[int, ...]:
        """Groups without which the joint hit would be longer."""
        return tuple(g.group for g in self.groups if g.capped)

    def __str__(self) -> str:
        lines = [f"request {self.request_id!r}: hit {self.hit_tokens} of {self.prompt_tokens} prompt tokens "
                 f"(at most {self.limit_tokens}: {self.lost_to_block_rounding} past the last whole block, "
                 f"{self.lost_to_one_token_minimum} kept for the one-token minimum)"]
        if not self.caching:
            lines.append("  prefix caching is off")
        for tier, blocks in (self.loaded_blocks or {}).items():
            lines.append(f"  loaded from the {tier} tier: {', '.join(map(str, blocks))} blocks per group")
        for g in self.groups:
            note = ""
            if g.capped:
                note = f"  capped the hit: {g.without_tokens} without it"
            elif g.limits:
                note = "  serves nothing longer"
            lines.append(f"  group {g.group} {g.kind:15s} alone {g.alone_tokens:6d}{note}")
        return "\n".join(lines)


def _token_ids(token_ids, what: str) -> tuple[list, bytes]:
    """Token ids as a list and as their canonical bytes (little-endian
    int64, what the hash reads), checked in C: every id an integer in int64
    range, none negative. A list is packed by one struct call (about half
    the time of array("q", ...)); an int64 array("q") or a numpy integer
    array gives its bytes with no per-id conversion."""
    if isinstance(token_ids, (str, bytes)) or not (
            isinstance(token_ids, (list, tuple, range, array)) or hasattr(token_ids, "__array__")
            or isinstance(token_ids, Sequence)):
        raise ValueError(f"{what} must be a sequence of token ids (ints), got {type(token_ids).__name__}")
    kind = getattr(getattr(token_ids, "dtype", None), "kind", None)
    if isinstance(token_ids, array) and token_ids.typecode == "q":
        data, tokens = token_bytes_of(token_ids), token_ids.tolist()
    elif kind in ("i", "u") and getattr(token_ids, "ndim", 0) == 1:
        # numpy: uint64 ids past the int64 range wrap to negative, caught below
        data, tokens = token_ids.astype("<i8", copy=False).tobytes(), token_ids.tolist()
    else:
        try:
            # (A Struct's pack takes the ids alone: about a fifth faster than
            # struct.pack, whose format rides in front of them.)
            data = struct.Struct(f"<{len(token_ids)}q").pack(*token_ids)
        except (struct.error, TypeError):
            raise ValueError(f"{what} must hold only integer token ids in int64 range") from None
        if type(token_ids) is list:
            tokens = list(token_ids)
        else:  # ints, whatever integer type came in
            tokens = list(struct.unpack(f"<{len(token_ids)}q", data))
    # A negative int64 has its top byte >= 0x80 (little-endian: every 8th byte).
    if not data[7::8].isascii():
        if min(tokens) < 0:
            raise ValueError(f"{what} holds a negative token id ({min(tokens)})")
        raise ValueError(f"{what} must hold only integer token ids in int64 range (got {max(tokens)})")
    return tokens, data


def _count(value, what: str) -> int:
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise ValueError(f"{what} must be an integer, got {value!r}")
        value = value.__index__()
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


# At most this many planned checkpoints inside one prefill chunk (each costs
# a state block while the chunk runs, and a pass of the recurrent scans).
MAX_CHECKPOINTS_INSIDE = 16


class KVCacheManager:
    def __init__(
        self,
        layout: KVCacheLayout,
        enable_prefix_caching: bool = True,
        hash_function="sha256",
        checkpoint_policy: str | CheckpointPolicy = "hybridkv",
        enable_kv_events: bool = False,
        checkpoints_inside_chunks: bool = False,
    ):
        if not isinstance(layout, KVCacheLayout):
            raise ValueError(f"KVCacheManager needs a KVCacheLayout (from plan_layout), got {type(layout).__name__}")
        self.layout = layout
        self.block_size = layout.block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.hasher = BlockHasher(hash_function)
        self.coordinator = make_coordinator(layout, self.enable_prefix_caching, self.hasher,
                                            get_policy(checkpoint_policy))
        self.block_cache = self.coordinator.block_cache
        # The runner saves recurrent states at checkpoints inside a prefill
        # chunk (get_checkpoint_pages): chunks no longer end at checkpoints.
        self.checkpoints_inside_chunks = bool(checkpoints_inside_chunks) and self.coordinator.checkpoints is not None
        recurrent = [m for m in self.coordinator.managers if m.recurrent]
        for manager in recurrent:
            manager.inside = self.checkpoints_inside_chunks
        self._state_pages = sum(m.width for m in recurrent)  # one state of every recurrent group
        if enable_kv_events:
            self.block_cache.events = []
        self._requests: dict[str, CacheRequest] = {}
        self._num_started = 0
        self._queried_tokens = 0
        self._hit_tokens = 0
        self._capped_tokens = [0] * len(layout.groups)

    # -- requests ------------------------------------------------------------
    def _get(self, request_id) -> CacheRequest:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None

    def __contains__(self, request_id) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    cache_salt: str | None = None, extra_keys: Sequence | None = None,
                    read_cache: bool = True) -> None:
        """Register a request with its prompt; no blocks are taken yet.
        `read_cache=False`: it takes no prefix hit and computes every token
        (an engine request that wants every prompt row's logits); the blocks
        it computes are cached for others all the same."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        tokens, data = _token_ids(prompt_token_ids, "prompt_token_ids")
        if not tokens:
            raise ValueError("empty prompt: a request needs at least one token")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        root = self.hasher.root(cache_salt, extra_keys) if self.enable_prefix_caching else None
        req = self.coordinator.new_request(request_id, tokens, root)
        req.reads_cache = bool(read_cache)
        if self.enable_prefix_caching:
            req.prompt_bytes = data  # hashed later without converting again
        self.coordinator.sight(req)
        self._requests[request_id] = req

    def get_computed_tokens(self, request_id: str) -> int:
        """Tokens the request has computed, or, before its first allocation,
        the longest prefix hit it would take. No side effect."""
        req = self._get(request_id)
        if req.started:
            return req.num_computed
        return self._hit(req)

    def _hit(self, req: CacheRequest) -> int:
        # Remembered while no cache key changed and no token was appended
        # (more tokens can make a longer hit).
        memo = req.hit_memo
        if memo is not None and memo.version == self.block_cache.version and memo.num_tokens == len(req.tokens):
            return memo.hit
        coordinator = self.coordinator
        if not req.reads_cache:
            req.hit_memo = HitMemo(self.block_cache.version, len(req.tokens), 0, None)
            return 0
        hit = coordinator.find_hit(req)  # over the pool and the tiers' index: nothing is read
        req.hit_memo = HitMemo(self.block_cache.version, len(req.tokens), hit, None)
        return hit

    def _why(self, req: CacheRequest, hit: int) -> tuple:
        """(alone, without) per group for the hit just found (memoised with it)."""
        memo = req.hit_memo
        if memo.why is None:
            req.hit_memo = memo = memo._replace(why=self.coordinator.why(req, hit))
        return memo.why

    def explain_hit(self, request_id: str) -> HitExplanation:
        """Why the request's prefix hit is as long as it is: before its first
        allocation, the hit it would take now; after, the hit it took. Per
        group the longest hit it alone serves and the joint hit without it
        (as cheap as get_computed_tokens, and free when nothing was missed)."""
        req = self._get(request_id)
        loaded = None
        if req.started:
            prompt, hit, alone, without, loaded = req.lookup
        else:
            prompt, hit = len(req.tokens), self._hit(req)
            alone, without = self._why(req, hit)
        bs = self.block_size
        whole = prompt // bs * bs
        limit = (prompt - 1) // bs * bs  # whole blocks, one token left to compute
        caching = self.enable_prefix_caching
        groups = tuple(
            GroupHit(m.index, m.kind, alone[m.index], without[m.index], without[m.index] - hit,
                     caching and alone[m.index] == hit < limit)
            for m in self.coordinator.managers)
        return HitExplanation(request_id, prompt, hit, limit if caching else 0, prompt - whole,
                              whole - limit if caching else 0, groups, caching,
                              {t: tuple(n) for t, n in loaded.items()} if loaded else None)

    def allocate_slots(self, request_id: str, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        """Room for the next `num_new_tokens` tokens (beyond the computed ones
        and, on the first call, beyond the prefix hit, which it takes), and
        for `num_lookahead` draft tokens after them (speculative decoding:
        drafts are not appended; see mark_computed). All or nothing: False,
        with nothing changed, if the pool cannot hold them now.
        (A decode step over many requests: `allocate_slots_many`.)"""
        req = self._get(request_id)
        num_new_tokens = _count(num_new_tokens, "num_new_tokens")
        num_lookahead = _count(num_lookahead, "num_lookahead")
        hit = None if req.started else self._hit(req)
        start = req.num_computed if req.started else hit
        if start + num_new_tokens > len(req.tokens):
            raise ValueError(
                f"request {request_id!r}: slots for tokens up to {start + num_new_tokens} asked, "
                f"but only {len(req.tokens)} token ids are known (append them first)")
        total = num_new_tokens + num_lookahead
        if hit is None:
            ok = self.coordinator.grow(req, total)
        else:
            ok = self.coordinator.start(req, total, hit)
        if ok and num_lookahead:
            req.lookahead = num_lookahead
            req.fast = NO_FAST_PATH  # mark_computed takes the slow path, which drops the rejected slots
        if ok and hit is not None:
            self._num_started += 1
            self._queried_tokens += len(req.tokens)
            self._hit_tokens += hit
            req.hit_memo = None
            capped = self._capped_tokens
            for g, without in enumerate(req.lookup.without):
                capped[g] += without - hit
        return ok

    def mark_computed(self, request_id: str, num_tokens: int) -> None:
        """The forward pass computed the next `num_tokens` tokens: cache the
        blocks they complete and release what the layers no longer read.
        After a step with lookahead slots, `num_tokens` counts only the new
        tokens and the accepted drafts (append those first): the slots past
        them are dropped, and blocks holding only rejected drafts go back to
        the pool. Nothing is cached or released by a rejected position.
        (A decode step over many requests: `mark_computed_many`.)"""
        req = self._get(request_id)
        num_tokens = _count(num_tokens, "num_tokens")
        if req.num_computed + num_tokens > req.num_allocated:
            raise ValueError(
                f"request {request_id!r}: {num_tokens} tokens marked computed, but only "
                f"{req.num_allocated - req.num_computed} have slots")
        if req.lookahead and req.num_computed + num_tokens > len(req.tokens):
            raise ValueError(
                f"request {request_id!r}: tokens up to {req.num_computed + num_tokens} marked computed, but "
                f"only {len(req.tokens)} token ids are known (append the accepted draft tokens first)")
        if num_tokens:
            self.coordinator.mark_computed(req, num_tokens)
        if req.lookahead:
            req.lookahead = 0
            self.coordinator.drop_lookahead(req)

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Sampled tokens join the request (their slots come with the next
        allocate_slots). (One token each for many requests:
        `append_token_ids_many`.)"""
        self._get(request_id).tokens.extend(_token_ids(token_ids, "token_ids")[0])

    def token_ids(self, request_id: str) -> list[int]:
        """The request's token ids, prompt and appended: the manager's own
        list, live (an engine reads it instead of keeping a copy; never
        modify it but through append_token_ids)."""
        return self._get(request_id).tokens

    # -- a decode step for many requests at once ------------------------------
    # The calls an engine's decode step makes, for a list of requests: a step
    # decoding hundreds of requests saves the argument checks per request, and
    # within the coordinator's fast path (FastPath) each is a comparison. A
    # request the checks do not clear takes the single-request call.
    def allocate_slots_many(self, request_ids: Sequence[str], num_new_tokens: int = 1, num_lookahead: int = 0) -> int:
        """`allocate_slots` for each request in order; stops at the first that
        does not fit and returns how many got their slots."""
        num_new_tokens = _count(num_new_tokens, "num_new_tokens")
        if _count(num_lookahead, "num_lookahead"):
            for i, request_id in enumerate(request_ids):
                if not self.allocate_slots(request_id, num_new_tokens, num_lookahead):
                    return i
            return len(request_ids)
        requests, grow = self._requests, self.coordinator.grow
        for i, request_id in enumerate(request_ids):
            req = requests.get(request_id)
            if req is not None:
                target = req.num_computed + num_new_tokens
                if target <= len(req.tokens):
                    # Coordinator.grow's first test, inline: this loop runs per request per step.
                    if target <= req.fast.room:
                        if target > req.num_allocated:
                            req.num_allocated = target
                        continue
                    if req.started:
                        if grow(req, num_new_tokens):
                            continue
                        return i
            if not self.allocate_slots(request_id, num_new_tokens):
                return i
        return len(request_ids)

    def mark_computed_many(self, request_ids: Sequence[str], num_tokens: int = 1) -> None:
        """`mark_computed` for each request."""
        num_tokens = _count(num_tokens, "num_tokens")
        requests, mark = self._requests, self.coordinator.mark_computed
        for request_id in request_ids:
            req = requests.get(request_id)
            if req is not None:
                n = req.num_computed + num_tokens
                if n <= req.num_allocated:
                    # Coordinator.mark_computed's first test, inline, as above.
                    if n < req.fast.quiet_until:
                        req.num_computed = n
                        continue
                    if num_tokens and not req.lookahead:
                        mark(req, num_tokens)
                        continue
            self.mark_computed(request_id, num_tokens)

    def append_token_ids_many(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """One sampled token per request: `token_ids[i]` joins `request_ids[i]`."""
        if len(request_ids) != len(token_ids):
            raise ValueError(f"{len(request_ids)} requests but {len(token_ids)} tokens")
        requests = self._requests
        for request_id, token in zip(request_ids, token_ids):
            req = requests.get(request_id)
            if req is not None and type(token) is int and token >= 0:
                req.tokens.append(token)
            else:
                self.append_token_ids(request_id, [token])

    def fork(self, parent_id: str, child_id: str) -> None:
        """A child sharing the parent's blocks (parallel sampling). A partly
        filled block is copied when either one first writes into it; the
        copies appear in `take_copies()`."""
        parent = self._get(parent_id)
        if not isinstance(child_id, str) or not child_id:
            raise ValueError(f"request id must be a non-empty string, got {child_id!r}")
        if child_id in self._requests:
            raise ValueError(f"duplicate request id {child_id!r}")
        if not parent.started or parent.num_allocated != parent.num_computed:
            raise ValueError(f"request {parent_id!r} can be forked only between steps, once it has computed tokens")
        child = self.coordinator.new_request(child_id, list(parent.tokens), parent.root)
        self.coordinator.fork(parent, child)
        self._requests[child_id] = child

    def free(self, request_id: str) -> None:
        """Release every block of the request (cached content stays, LRU)."""
        req = self._get(request_id)
        self.coordinator.free(req)
        del self._requests[request_id]

    # -- what the runner reads -------------------------------------------------
    def get_page_tables(self, request_id: str) -> list[list[int]]:
        """Per group, the pages the runner reads and writes for the request:
        for a group of block tables, the pages of its blocks in order (a
        block spans `group.pages_per_block` pages; null pages where a layer
        no longer needs the tokens); for a recurrent group, the pages of the
        block holding its state (empty before the first allocation)."""
        req = self._get(request_id)
        return [manager.page_table(req) for manager in self.coordinator.managers]

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Deprecated name of `get_page_tables` (it returns pages)."""
        warnings.warn("get_block_tables is deprecated: use get_page_tables (it returns page ids)",
                      DeprecationWarning, stacklevel=2)
        return self.get_page_tables(request_id)

    def table_version(self, request_id: str) -> int:
        """Changes whenever one of the request's page tables changes (so a
        runner can keep its tensors of them between steps)."""
        return self._get(request_id).table_version

    def get_state_pages(self, request_id: str) -> dict[int, tuple]:
        """Per recurrent group (`group.recurrent`): (pages to read the state
        from, or None for the zero state; pages to write the next state
        into, or None before allocate_slots). The same pages when the update
        is in place."""
        req = self._get(request_id)
        return {manager.index: manager.state_pages(req) for manager in self.coordinator.managers
                if manager.group.recurrent}

    def get_state_blocks(self, request_id: str) -> dict[int, tuple]:
        """Deprecated name of `get_state_pages` (it returns pages)."""
        warnings.warn("get_state_blocks is deprecated: use get_state_pages (it returns page ids)",
                      DeprecationWarning, stacklevel=2)
        return self.get_state_pages(request_id)

    def take_copies(self) -> dict[int, list[tuple[int, int]]]:
        """Page copies (src, dst) per group to make before the next forward."""
        return self.coordinator.take_copies()

    def next_checkpoint(self, request_id: str) -> int | None:
        """The next position where the request saves a Mamba state (also
        before the first allocation: the first chunk starts at the hit).
        None if there is none ahead. A prefill chunk must end there unless
        `checkpoints_inside_chunks`; a speculative step never passes it."""
        req = self._get(request_id)
        return self.coordinator.next_checkpoint(req, 0 if req.started else self._hit(req))

    def next_chunk(self, request_id: str, budget: int, inside: bool = True) -> int:
        """How many tokens to compute next: what is left of the known tokens
        (after the prefix hit, before the first allocation), at most `budget`,
        and ending at the next Mamba checkpoint. With
        `checkpoints_inside_chunks` the chunk runs on past up to
        MAX_CHECKPOINTS_INSIDE planned checkpoints, as many as the free pages
        hold a state for beside the chunk's own (else it ends at the next
        one, as without: a full pool never fails for want of them).
        `inside=False`: the chunk ends at the next checkpoint regardless."""
        req = self._get(request_id)
        done = req.num_computed if req.started else self._hit(req)
        count = min(len(req.tokens) - done, _count(budget, "budget"))
        skip = 0
        if self.checkpoints_inside_chunks and inside:
            # Beside the chunk's own pages, and one more state: a request whose hit is a checkpoint
            # holds that state's block and its live one while it runs (pages_per_request counts one).
            spare = self.block_cache.num_free_pages - self.layout.pages_per_request(done + count, count)
            skip = max(0, min(MAX_CHECKPOINTS_INSIDE, spare // self._state_pages - 1))
        checkpoint = self.coordinator.next_checkpoint(req, done, skip)
        if checkpoint is not None and done < checkpoint < done + count:
            count = checkpoint - done
        return count

    def get_checkpoint_pages(self, request_id: str) -> dict[int, list[tuple[int, tuple]]]:
        """Per recurrent group, (position, pages) of each checkpoint strictly
        inside the request's allocated tokens (only with
        `checkpoints_inside_chunks`; an empty dict when there is none): the
        next pass writes the state after `position` tokens there, as a chunk
        ending at the position would leave it in its write pages; the
        manager caches it when the tokens are marked computed."""
        req = self._get(request_id)
        return {m.index: m.saving_pages(req) for m in self.coordinator.managers
                if m.recurrent and req.saving[m.index]}

    def block_keys(self, request_id: str, start: int, end: int) -> list:
        """Cache keys of the request's full blocks whose last token lies in
        tokens [start, end) (a scheduler uses them to see that two prompts
        computed in one step would share a block). Empty without caching."""
        req = self._get(request_id)
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        first, last = -(-start // bs) if start % bs else start // bs, min(end, len(req.tokens)) // bs
        self.coordinator.extend_keys(req, last)
        return req.keys[first:last]

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).tokens)

    def pages_per_request(self, num_tokens: int, chunk: int = 1) -> int:
        return self.layout.pages_per_request(num_tokens, chunk)

    # -- the pool --------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages no request holds (the null page not counted)."""
        return self.block_cache.num_free_pages

    @property
    def num_total_pages(self) -> int:
        """Usable pages (the null page not counted)."""
        return self.block_cache.num_pages - 1

    @property
    def num_free_blocks(self) -> int:
        """Deprecated name of `num_free_pages` (it counts pages)."""
        warnings.warn("num_free_blocks is deprecated: use num_free_pages", DeprecationWarning, stacklevel=2)
        return self.num_free_pages

    @property
    def num_total_blocks(self) -> int:
        """Deprecated name of `num_total_pages` (it counts pages)."""
        warnings.warn("num_total_blocks is deprecated: use num_total_pages", DeprecationWarning, stacklevel=2)
        return self.num_total_pages

    @property
    def usage(self) -> float:
        return 1.0 - self.block_cache.num_free_pages / (self.block_cache.num_pages - 1)

    @property
    def stats(self) -> CacheStats:
        managers = self.coordinator.managers
        cache = self.block_cache
        return CacheStats(self._num_started, self._queried_tokens, self._hit_tokens,
                          cache.num_cached_blocks, cache.num_evictions,
                          cache.num_free_pages, cache.num_pages - 1,
                          tuple(getattr(m, "released_pages", 0) for m in managers),
                          tuple(m.kind for m in managers), tuple(self._capped_tokens),
                          {r: tuple(cache.evictions[r]) for r in EVICTION_REASONS},
                          {t: tuple(n) for t, n in self.coordinator.tier_loads.items()})

    def take_events(self) -> list:
        """What happened to the set of keys the pool can serve since the last
        call, in order (core/events.py); needs enable_kv_events=True."""
        raw = self.block_cache.events
        if raw is None:
            raise ValueError("KV events are off: make the manager with enable_kv_events=True")
        if not raw:  # most decode steps store and remove nothing
            return []
        self.block_cache.events = []
        managers = self.coordinator.managers
        out = []
        for event in raw:
            if event[0] == "stored":
                _, g, keys, parent, tokens = event
                out.append(BlockStored(keys, parent, tokens, self.block_size, g, managers[g].kind))
            elif event[0] == "removed":
                _, g, key = event
                if out and type(out[-1]) is BlockRemoved and out[-1].group_idx == g:
                    out[-1].block_hashes.append(key)  # one event per run of removals in a group
                else:
                    out.append(BlockRemoved([key], g))
            else:
                out.append(AllBlocksCleared())
        return out

    def attach_tier(self, tier) -> None:
        """Put the tiers' index below the pool (core/tiers.py `TierIndex`):
        evicted blocks are stored through it, hits load from it."""
        self.coordinator.attach_tier(tier)

    def blocks_for_hit(self, request_id: str, num_tokens: int) -> list[tuple]:
        """What another engine needs to take a hit of the request's first
        `num_tokens` tokens (whole blocks, computed): per group, (group,
        key, pages) of the cached blocks that hit reads and no others
        (coordinator.blocks_for_hit). Prefill/decode on different engines
        ships exactly these."""
        req = self._get(request_id)
        num_tokens = _count(num_tokens, "num_tokens")
        if num_tokens % self.block_size or num_tokens > req.num_computed:
            raise ValueError(f"request {request_id!r}: a hit of {num_tokens} tokens must be whole blocks of "
                             f"{self.block_size} within the {req.num_computed} computed")
        if not self.enable_prefix_caching:
            return []
        return self.coordinator.blocks_for_hit(req, num_tokens // self.block_size)

    def tier_loads_failed(self, loads) -> list[str]:
        """Loads of a step's plan that failed (core/tiers.py `BlockLoad`s,
        their keys already out of the tiers' index): their blocks never held
        their content, so each leaves the cache, and every request that
        holds one must compute again. Returns those requests' ids (the
        caller frees them before their computed tokens are marked, and
        admits them again: their hit is what is left)."""
        return self.coordinator.drop_lost(loads, self._requests.values())

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (e.g. after weights change), in the
        tier below the pool too. Blocks in use stay with their requests.
        Returns the number of keys dropped from the pool."""
        if self.coordinator.tier is not None:
            self.coordinator.tier.clear()
        dropped = self.block_cache.reset()
        if self.coordinator.checkpoints is not None:
            self.coordinator.checkpoints.clear()
        return dropped

    def cached_keys(self, group: int) -> list:
        """The keys of the blocks group `group` can serve from the pool now
        (a copy, in no set order): what a snapshot of the KV events, or a
        tier writing the pool out, needs. O(cached blocks of the group)."""
        self._check_group(group)
        return list(self.block_cache.cached[group])

    def cached_pages(self, group: int) -> list[tuple]:
        """(key, pages) of every block group `group` caches in the pool: the
        pages hold its content now (a copy of the list; valid until the
        next allocation may reuse them). O(cached blocks of the group)."""
        self._check_group(group)
        width = self.coordinator.managers[group].width
        cache = self.block_cache
        return [(key, cache.pages(block, width)) for key, block in cache.cached[group].items()]

    def _check_group(self, group: int) -> None:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.layout.groups):
            raise ValueError(f"group must be an index in [0, {len(self.layout.groups)}), got {group!r}")

    def pages_in_use_by_group(self) -> list[int]:
        """Pages the live requests hold, per group (shared blocks counted
        once). O(blocks held): for reports, not for the step loop."""
        seen: list[set[int]] = [set() for _ in self.coordinator.managers]
        for req in self._requests.values():
            for manager in self.coordinator.managers:
                seen[manager.index].update(manager.held_blocks(req))
        return [sum(self.block_cache.width(b) for b in blocks) for blocks in seen]

    def check_invariants(self) -> None:
        """Assert the pool invariants against every request's references
        (for tests; O(pool))."""
        held: dict = {}
        for req in self._requests.values():
            for manager in self.coordinator.managers:
                for block in manager.held_blocks(req):
                    held[block] = held.get(block, 0) + 1
                if not manager.recurrent:  # (AttentionManager.free skips these)
                    released = req.tables[manager.index][:req.num_released[manager.index]]
                    assert not any(released), (
                        f"request {req.request_id!r}, group {manager.index}: a block before the released ones")
        self.block_cache.check_invariants(held)
