"""The coordinator: all groups of one model acting as one.

It owns the block cache and one manager per group, finds the longest prefix hit that
every group can serve, and makes allocation all-or-nothing across groups.
Two kinds, chosen by `make_coordinator` from the layout:

* `UnitaryCoordinator`: one group (a full-attention-only model, or one kind
  of layer). Its manager's longest hit is the hit.
* `HybridCoordinator`: N groups of any types. The hit rule (docs/architecture.md)
  is a fixed point: start from the longest candidate, let each group lower it
  to its own longest valid hit at most that long, and repeat until a whole
  pass lowers it no more. Each pass strictly lowers the candidate or ends,
  and each group's answer is the longest it can serve, so the result is the
  longest hit valid for all groups (tests/test_hit_rule.py checks it against
  brute force).

Both also say why a hit is as short as it is (`explain`): per group the
longest hit it alone could serve, and the joint hit without it.

A started request's steps mostly need nothing from the groups: the
`FastPath` says until where, and the coordinator skips them that far.
"""

from __future__ import annotations

from .block_cache import BlockCache
from .checkpoints import CheckpointPlanner, CheckpointPolicy
from .hashing import BlockHasher, KnownChains, token_bytes
from .layout import KVCacheLayout
from .managers import make_manager
from .page_allocator import NULL
from .request import NO_FAST_PATH, CacheRequest, FastPath, Lookup, ScanMemo
from .specs import NEVER

# Groups whose hits are sparsest go first, so the candidate drops fastest:
# recurrent groups (checkpoints only), then full, chunked, sliding.
_LOOKUP_ORDER = {"full": 1, "chunked_local": 2, "sliding_window": 3}


class Coordinator:
    """What both kinds share: requests, allocation, progress, forks."""

    def __init__(self, layout: KVCacheLayout, caching: bool, hasher: BlockHasher, policy: CheckpointPolicy):
        self.layout = layout
        self.block_size = layout.block_size
        self.caching = caching
        self.hasher = hasher
        self.known_chains = KnownChains(layout.block_size)
        self.block_cache = BlockCache(layout.num_pages, len(layout.groups))
        # Positions where recurrent groups save states (None: no group
        # saves any).
        recurrent = any(g.recurrent for g in layout.groups)
        self.checkpoints = CheckpointPlanner(policy, self.block_size, self.extend_keys) \
            if caching and recurrent else None
        self.managers = [make_manager(g, self.block_cache, caching, hasher.verifies, self.checkpoints)
                         for g in layout.groups]
        self._lookup_order = sorted(self.managers, key=lambda m: 0 if m.recurrent else _LOOKUP_ORDER[m.kind])
        self._events_follow_allocation = any(m.events_follow_allocation for m in self.managers)
        self.pending_copies: list = []  # (group, src pages, dst pages), for the runner
        self.tier = None  # the store below the pool (core/tiers.py), once attached
        self.tier_loads: dict[str, list[int]] = {}  # tier -> per group, blocks loaded into the pool

    def attach_tier(self, tier) -> None:
        """Put the tiers' index (core/tiers.py) below the pool: evicted
        blocks are stored through it, lookups read it, hits load from it."""
        if not self.caching:
            raise ValueError("a tier below the pool needs prefix caching")
        if self.hasher.verifies:
            raise ValueError("a tier below the pool needs a trusted hash (hash_function='sha256'): "
                             "it keeps no token ids to check")
        self.tier = tier
        cache = self.block_cache
        pages = cache.pages
        widths = [m.width for m in self.managers]
        cache.spill = lambda group, key, block: tier.put(group, key, pages(block, widths[group]))

        def changed() -> None:  # a key left the tier: remembered lookups may be stale
            cache.version += 1
        tier.changed = changed
        for manager in self.managers:
            manager.tier_index = tier.index[manager.index]

    def new_request(self, request_id: str, tokens: list[int], root) -> CacheRequest:
        return CacheRequest(request_id, tokens, root, [m.empty_table() for m in self.managers])

    def sight(self, req: CacheRequest) -> None:
        """Record a new request's prompt for branch points (checkpoints.py)."""
        if self.checkpoints is not None:
            self.checkpoints.sight(req)

    # -- prefix hits ----------------------------------------------------------
    def hit_limit(self, req: CacheRequest) -> int:
        """The longest hit any cache could give, in blocks: whole blocks, and
        at least one token left to compute. Extends the request's keys that far."""
        limit = (len(req.tokens) - 1) // self.block_size
        self.extend_keys(req, limit)
        return limit

    def scan(self, req: CacheRequest) -> tuple[list, list]:
        """Per group, what the cache holds for the request's block positions
        below the hit limit: the blocks (`found`, None where none) and the
        same as a mask for the hit searches. One dictionary lookup per block
        and group (in a pool this large, each a few cache misses: the lookup's
        main cost), shared by find_hit, explain and the first allocation,
        and remembered while no cache key changes and the limit stays."""
        limit = self.hit_limit(req)
        memo = req.scan
        version = self.block_cache.version
        if memo is None or memo.version != version or memo.limit != limit:
            scans = [m.scan(req, limit) for m in self.managers]
            memo = req.scan = ScanMemo(version, limit, [s[0] for s in scans], [s[1] for s in scans])
        return memo.found, memo.masks

    def find_hit(self, req: CacheRequest) -> int:
        """Longest valid hit in tokens: a multiple of the block size, at most
        len(tokens) - 1 so that at least one token is computed."""
        raise NotImplementedError

    def why(self, req: CacheRequest, hit: int) -> tuple[list[int], list[int]]:
        """`explain`, free when nothing was missed or caching is off."""
        if not self.caching:
            zeros = [0] * len(self.managers)
            return zeros, zeros
        if hit == self.hit_limit(req) * self.block_size:
            same = [hit] * len(self.managers)
            return same, same
        return self.explain(req, hit)

    def explain(self, req: CacheRequest, hit: int) -> tuple[list[int], list[int]]:
        """For the hit `find_hit` gave (tokens): per group, the longest hit it
        alone could serve, and the joint hit if it could serve anything; in
        tokens. The request's keys reach the limit (find_hit ran)."""
        raise NotImplementedError

    def extend_keys(self, req: CacheRequest, num_blocks: int) -> None:
        keys = req.keys
        if len(keys) < num_blocks:
            first = not keys and req.prompt_bytes is not None
            if first:  # the blocks a recent request shares with this prompt are hashed already
                self.known_chains.seed(keys, req.root, req.prompt_bytes)
            if len(keys) < num_blocks:
                self.hasher.extend(keys, req.root, req.tokens, self.block_size, num_blocks, req.prompt_bytes)
            if first:
                self.known_chains.remember(req.root, req.prompt_bytes, keys)

    # -- allocation --------------------------------------------------------
    # Both verbs give room for `num_new_tokens` more tokens, or return False
    # and change nothing.
    def grow(self, req: CacheRequest, num_new_tokens: int) -> bool:
        """A started request's next tokens: a comparison within the fast path."""
        target = req.num_computed + num_new_tokens
        fast = req.fast
        if target <= fast.room:
            if target > req.num_allocated:
                req.num_allocated = target
            return True
        managers = self.managers
        needs = []
        pages = 0
        for manager in managers:
            count = manager.blocks_needed(req, target)
            needs.append((manager.width, count))
            pages += count * manager.width
        cache = self.block_cache
        if pages > cache.num_free_pages:
            return False
        copies = self.pending_copies
        # One call for all groups, as in `start`.
        for manager, blocks in zip(managers, cache.allocate(needs) if pages else [[]] * len(managers)):
            manager.allocate(req, target, copies, blocks)
        if target > req.num_allocated:
            req.num_allocated = target
        self._refresh(req, self._events_follow_allocation or fast is NO_FAST_PATH)
        return True

    def start(self, req: CacheRequest, num_new_tokens: int, hit: int) -> bool:
        """The first allocation: take the prefix hit `hit` (tokens), then room
        for the new tokens. Each of the hit's blocks that a tier serves gets
        a fresh block, which the step's plan loads before any step reads it."""
        managers = self.managers
        hit_blocks = hit // self.block_size
        target = hit + num_new_tokens
        found = None
        loads = None  # per group: (position, TierRef) of the hit blocks a tier serves
        if hit_blocks:
            found = [m.hit_blocks(f, hit_blocks) for m, f in zip(managers, self.scan(req)[0])]
            if self.tier is not None:
                loads = [[] for _ in managers]
                for g, blocks in enumerate(found):
                    for position, block in enumerate(blocks):
                        if block and type(block) is not int:
                            loads[g].append((position, block))
                            blocks[position] = NULL  # until loaded (place_loaded)
        req.num_computed = hit  # as it will be once the hit is taken
        counts = []
        pages = 0
        for g, manager in enumerate(managers):
            blocks = found[g] if found else []
            count = manager.blocks_for_start(req, target, blocks) + (len(loads[g]) if loads else 0)
            counts.append((manager.width, count))
            pages += count * manager.width
            pages += self.block_cache.free_pages_in(blocks)  # hit blocks waiting in the free queue
        if pages > self.block_cache.num_free_pages:
            req.num_computed = 0
            return False
        # It fits: say why the hit is what it is, before the allocation
        # evicts anything the lookup saw (and never for attempts that fail).
        req.lookup = Lookup(len(req.tokens), hit, *self.why(req, hit))
        for g, manager in enumerate(managers):
            manager.install_hit(req, found[g] if found else [], hit_blocks)
        req.started = True
        req.scan = None
        if self.checkpoints is not None:
            self.checkpoints.plan(req, hit)
        # One call for all groups: reused blocks go to the group of their
        # width, so fewer are taken apart (BlockCache.allocate).
        for manager, blocks in zip(managers, self.block_cache.allocate(counts)):
            taken = len(loads[manager.index]) if loads else 0
            if taken:
                self._load(req, manager, loads[manager.index], blocks[:taken], hit_blocks)
            manager.start(req, blocks[taken:])
        req.num_allocated = target
        self._refresh(req)
        return True

    def _load(self, req: CacheRequest, manager, loads: list, blocks: list[int], hit_blocks: int) -> None:
        """Tier blocks of a hit into fresh pool blocks: their load (in the
        step's plan), their key (they are cached content again), their place
        in the request."""
        g = manager.index
        groups = len(self.managers)
        mine = dict(req.lookup.loaded or {})
        chain = {key: j for j, key in enumerate(req.keys[:hit_blocks])}  # key -> its position, for parents
        for (position, tier_ref), block in zip(loads, blocks):
            self.tier.load(req.request_id, tier_ref, self.block_cache.pages(block, manager.width))
            j = chain[tier_ref.key]
            bs = manager.block_size
            self.block_cache.store(g, [block], [tier_ref.key], parent=req.keys[j - 1] if j else req.root,
                                   token_ids=req.tokens[j * bs:(j + 1) * bs])
            manager.place_loaded(req, position, block)
            self.tier_loads.setdefault(tier_ref.tier, [0] * groups)[g] += 1
            mine.setdefault(tier_ref.tier, [0] * groups)[g] += 1
        req.lookup = req.lookup._replace(loaded=mine)

    def blocks_for_hit(self, req: CacheRequest, num_blocks: int) -> list[tuple]:
        """(group, key, pages) of the cached blocks that a hit of the first
        `num_blocks` blocks of the request's tokens reads, by each group's
        own rule: every block of a full-attention group, the blocks of the
        window (or chunk) that ends the hit, the recurrent state saved at
        its end. A block the pool no longer caches is left out (a hit over
        what is shipped is then shorter, never wrong)."""
        self.extend_keys(req, num_blocks)
        cache = self.block_cache
        out = []
        for manager in self.managers:
            cached = cache.cached[manager.index]
            for j in range(max(0, manager.hit_start(num_blocks)), num_blocks):
                block = cached.get(req.keys[j])
                if block is not None:
                    out.append((manager.index, req.keys[j], tuple(cache.pages(block, manager.width))))
        return out

    def drop_lost(self, loads, requests) -> list[str]:
        """Blocks whose tier loads failed leave the cache (reason "lost"),
        and the requests among `requests` that hold one are named (see
        KVCacheManager.tier_loads_failed). Only requests started in the
        step of the loads can hold such a block."""
        cache = self.block_cache
        lost: dict[int, set] = {}  # group -> blocks
        for load in loads:
            block = cache.cached[load.group].get(load.key)
            if block is not None and tuple(cache.pages(block, self.managers[load.group].width)) == load.pages:
                cache.evict([block], "lost")
                lost.setdefault(load.group, set()).add(block)
                self.tier_loads[load.tier][load.group] -= 1  # (counted as loaded when decided)
        if not lost:
            return []
        return [req.request_id for req in requests
                if any(not blocks.isdisjoint(self.managers[g].held_blocks(req)) for g, blocks in lost.items())]

    def _refresh(self, req: CacheRequest, events: bool = True) -> None:
        """Recompute the fast path after a slow path changed blocks
        (`events`: quiet_until too; an allocation leaves it as it was
        unless a group's events follow allocation)."""
        room = quiet_until = NEVER
        for manager in self.managers:
            bound, event = manager.bounds(req)
            if bound < room:
                room = bound
            if event < quiet_until:
                quiet_until = event
        # (tuple.__new__: a namedtuple's own __new__ is a Python function.)
        req.fast = tuple.__new__(FastPath, (room, quiet_until if events else req.fast.quiet_until))

    def next_checkpoint(self, req: CacheRequest, hit: int, skip: int = 0) -> int | None:
        """The next checkpoint after the computed tokens or, before the
        first allocation, after the hit it will take, past the first `skip`
        planned ones; None if there is none ahead."""
        return None if self.checkpoints is None else self.checkpoints.next_checkpoint(req, hit, skip)

    # -- progress ------------------------------------------------------------
    def mark_computed(self, req: CacheRequest, num_tokens: int) -> None:
        n = req.num_computed + num_tokens
        req.num_computed = n
        if n < req.fast.quiet_until:
            return
        if self.caching and len(req.keys) < n // self.block_size:
            self.extend_keys(req, n // self.block_size)
        for manager in self.managers:
            manager.on_computed(req)
        self._refresh(req)

    def drop_lookahead(self, req: CacheRequest) -> None:
        """After a speculative step: slots past the computed tokens go, and
        blocks holding only rejected drafts return to the pool."""
        req.num_allocated = req.num_computed
        for manager in self.managers:
            manager.trim(req)
        self._refresh(req)

    def free(self, req: CacheRequest) -> None:
        for manager in self.managers:
            manager.free(req)
        if req.prompt_bytes is not None and len(req.keys) * self.block_size > req.num_prompt_tokens:
            # Its keys now run past the prompt (the answer's blocks): a chat's next turn repeats them.
            data = req.prompt_bytes + token_bytes(req.tokens[req.num_prompt_tokens:len(req.keys) * self.block_size])
            self.known_chains.remember(req.root, data, req.keys)

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        child.inherit(parent)
        for manager in self.managers:
            manager.fork(parent, child)
        # Both now share the partly filled block: the next step of either
        # takes the slow path (copy on write).
        parent.fast = child.fast = NO_FAST_PATH

    def take_copies(self) -> dict[int, list[tuple[int, int]]]:
        """Page copies (src, dst) per group that the runner must make before
        the next forward pass (copy-on-write after a fork)."""
        out: dict[int, list[tuple[int, int]]] = {}
        for group, src, dst in self.pending_copies:
            out.setdefault(group, []).extend(zip(src, dst))
        self.pending_copies = []
        return out


class UnitaryCoordinator(Coordinator):
    """One group: no fixed point, its own longest hit is the hit."""

    def find_hit(self, req):
        if not self.caching:
            return 0
        masks = self.scan(req)[1]
        return self.managers[0].longest_hit(masks[0], self.hit_limit(req)) * self.block_size

    def explain(self, req, hit):
        # Without its only group nothing bounds the hit but the limit.
        return [hit], [self.hit_limit(req) * self.block_size]


class HybridCoordinator(Coordinator):
    """N groups of any types: the fixed point over the groups' own hits."""

    def find_hit(self, req):
        if not self.caching:
            return 0
        return fixed_point(self._lookup_order, self.scan(req)[1], self.hit_limit(req)) * self.block_size

    def explain(self, req, hit):
        bs = self.block_size
        limit = self.hit_limit(req)
        masks = self.scan(req)[1]
        alone = [m.longest_hit(masks[m.index], limit) for m in self.managers]
        # The smallest of the others' own bests, for each g: the smallest
        # overall unless g holds it, then the second smallest.
        order = sorted(range(len(alone)), key=alone.__getitem__)
        lowest, second = alone[order[0]], (alone[order[1]] if len(order) > 1 else limit)
        without = []
        for g in range(len(self.managers)):
            # Without group g the hit is at most the others' own best; if
            # that is the joint hit already, g changed nothing.
            bound = second if g == order[0] else lowest
            if bound * bs <= hit:
                without.append(hit)
            else:
                others = [m for m in self._lookup_order if m.index != g]
                without.append(fixed_point(others, masks, bound) * bs)
        return [a * bs for a in alone], without


def fixed_point(managers, masks: list[bytes], candidate: int) -> int:
    """The longest hit (blocks, at most `candidate`) every manager serves.
    Round robin: once the others have all accepted the candidate the last
    manager lowered it to, it is the answer (that manager's own answer is
    valid for it). Each lowering is strictly down, so this ends."""
    count = len(managers)
    accepted = 0
    i = 0
    while candidate > 0 and accepted < count:
        manager = managers[i]
        lowered = manager.longest_hit(masks[manager.index], candidate)
        if lowered == candidate:
            accepted += 1
        else:
            candidate = lowered
            accepted = 1
        i = i + 1 if i + 1 < count else 0
    return candidate


def make_coordinator(layout: KVCacheLayout, caching: bool, hasher: BlockHasher,
                     policy: CheckpointPolicy) -> Coordinator:
    """The coordinator for a layout: unitary for one group, hybrid for more."""
    kind = UnitaryCoordinator if len(layout.groups) == 1 else HybridCoordinator
    return kind(layout, caching, hasher, policy)
