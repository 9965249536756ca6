"""The coordinator: all groups of one model acting as one.

It owns the pool and one manager per group, finds the longest prefix hit that
every group can serve, and makes allocation all-or-nothing across groups.
Two kinds, chosen by `make_coordinator` from the layout:

* `UnitaryCoordinator`: one group (a full-attention-only model, or one kind
  of layer). Its manager's longest hit is the hit.
* `HybridCoordinator`: N groups of any types. The hit rule (DESIGN section 4)
  is a fixed point: start from the longest candidate, let each group lower it
  to its own longest valid hit at most that long, and repeat until a whole
  pass lowers it no more. Each pass strictly lowers the candidate or ends,
  and each group's answer is the longest it can serve, so the result is the
  longest hit valid for all groups (tests/test_hit_rule.py checks it against
  brute force).

Both also say why a hit is as short as it is (`explain`): per group the
longest hit it alone could serve, and the joint hit without it.
"""

from __future__ import annotations

from .block_pool import BlockPool
from .checkpoints import CheckpointPolicy, PrefixSightings
from .hashing import BlockHasher
from .layout import KVCacheLayout
from .managers import make_manager
from .managers.base import NEVER
from .request import CacheRequest

# Groups whose hits are sparsest go first, so the candidate drops fastest.
_LOOKUP_ORDER = {"mamba": 0, "full": 1, "chunked_local": 2, "sliding_window": 3}


class Coordinator:
    """What both kinds share: requests, allocation, progress, forks."""

    def __init__(self, layout: KVCacheLayout, caching: bool, hasher: BlockHasher, policy: CheckpointPolicy):
        self.layout = layout
        self.block_size = layout.block_size
        self.caching = caching
        self.hasher = hasher
        self.policy = policy
        self.pool = BlockPool(layout.num_pages, len(layout.groups))
        self.managers = [make_manager(g, self.pool, caching, hasher.verifies, policy) for g in layout.groups]
        self._lookup_order = sorted(self.managers, key=lambda m: _LOOKUP_ORDER[m.kind])
        self.has_mamba = any(m.kind == "mamba" for m in self.managers)
        self._attention = next((m for m in self.managers if m.kind != "mamba"), None)
        self._events_follow_allocation = any(m.events_follow_allocation for m in self.managers)
        self.sightings = PrefixSightings() if caching and self.has_mamba and policy.branch_points else None
        self.pending_copies: list = []  # (group, src pages, dst pages), for the runner

    def new_request(self, request_id: str, tokens: list[int], root) -> CacheRequest:
        return CacheRequest(request_id, tokens, [m.empty_table() for m in self.managers], root)

    def sight(self, req: CacheRequest) -> None:
        """Record a new request's prompt for branch points (checkpoints.py)."""
        if self.sightings is not None:
            blocks = len(req.tokens) // self.block_size
            self.extend_keys(req, blocks)
            self.sightings.record(req.keys[:blocks], req.request_id)

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
        version = self.pool.version
        if memo is None or memo[0] != version or memo[1] != limit:
            scans = [m.scan(req, limit) for m in self.managers]
            memo = req.scan = (version, limit, [s[0] for s in scans], [s[1] for s in scans])
        return memo[2], memo[3]

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
        if len(req.keys) < num_blocks:
            self.hasher.extend(req.keys, req.root, req.tokens, self.block_size, num_blocks, req.prompt_bytes)

    # -- allocation --------------------------------------------------------
    def allocate(self, req: CacheRequest, num_new_tokens: int, hit: int | None) -> bool:
        """Room for `num_new_tokens` more tokens, or False and no change.
        `hit` is the prefix hit to take on the request's first allocation."""
        if req.started:
            target = req.num_computed + num_new_tokens
            if target <= req.capacity and req.steady:
                # Decode fast path: the tokens land in blocks the request has.
                if target > req.num_allocated:
                    req.num_allocated = target
                return True
            return self._grow(req, target)
        return self._start(req, num_new_tokens, hit)

    def _grow(self, req: CacheRequest, target: int) -> bool:
        managers = self.managers
        pages = 0
        for manager in managers:
            pages += manager.pages_needed(req, target)
        if pages > self.pool.num_free_pages:
            return False
        copies = self.pending_copies
        for manager in managers:
            manager.allocate(req, target, copies)
        if target > req.num_allocated:
            req.num_allocated = target
        self._refresh(req, self._events_follow_allocation)
        return True

    def _start(self, req: CacheRequest, num_new_tokens: int, hit: int) -> bool:
        """The first allocation: take the hit, then room for the new tokens."""
        managers = self.managers
        hit_blocks = hit // self.block_size
        target = hit + num_new_tokens
        found = None
        if hit_blocks:
            found = [m.hit_blocks(f, hit_blocks) for m, f in zip(managers, self.scan(req)[0])]
        req.num_computed = hit  # as it will be once the hit is taken
        counts = []
        pages = 0
        ref, widths = self.pool.ref, self.pool.widths
        for g, manager in enumerate(managers):
            blocks = found[g] if found else []
            count = manager.blocks_for_start(req, target, blocks)
            counts.append((manager.width, count))
            pages += count * manager.width
            for block in blocks:
                if block and not ref[block]:  # free in the queue: taking it uses free pages
                    pages += widths[block]
        if pages > self.pool.num_free_pages:
            req.num_computed = 0
            return False
        # It fits: say why the hit is what it is, before the allocation
        # evicts anything the lookup saw (and never for attempts that fail).
        req.lookup = (len(req.tokens), hit, self.why(req, hit))
        for g, manager in enumerate(managers):
            manager.install_hit(req, found[g] if found else [], hit_blocks)
        req.started = True
        req.scan = None
        self.plan_checkpoints(req, hit)
        # One pool call for all groups: popped blocks go to the group of
        # their width, so fewer are cut (BlockPool.allocate_many).
        for manager, blocks in zip(managers, self.pool.allocate_many(counts)):
            manager.start(req, blocks)
        req.num_allocated = target
        self._refresh(req)
        return True

    def _refresh(self, req: CacheRequest, events: bool = True) -> None:
        """Recompute the fast-path bounds after a slow path changed blocks
        (`events`: next_event too; an allocation alone leaves it unchanged
        unless a group says otherwise)."""
        attention = self._attention
        req.capacity = len(req.tables[attention.index]) * self.block_size if attention else NEVER
        steady = True
        if events:
            event = NEVER
            for manager in self.managers:
                steady = steady and manager.is_steady(req)
                event = min(event, manager.next_event(req))
            req.next_event = event
        else:
            for manager in self.managers:
                if not manager.is_steady(req):
                    steady = False
                    break
        req.steady = steady

    def plan_checkpoints(self, req: CacheRequest, hit: int) -> None:
        """Choose where the request saves Mamba states inside its prompt."""
        if not (self.has_mamba and self.caching):
            return
        bs = self.block_size
        prompt_blocks = len(req.tokens) // bs
        self.extend_keys(req, prompt_blocks)
        keys = req.keys[:prompt_blocks]
        shared = 0
        if self.sightings is not None:
            shared = self.sightings.shared_blocks(keys) * bs
        req.checkpoints = self.policy.plan(len(req.tokens), bs, hit, shared)
        last = (len(req.tokens) - 1) // bs * bs
        req.probation_at = last if self.policy.on_probation(last, len(req.tokens), bs, shared) else -1

    def next_checkpoint(self, req: CacheRequest, hit: int) -> int | None:
        """The next planned checkpoint after the computed tokens (or, before
        the first allocation, after the hit it will take). Past the prompt,
        with rolling checkpoints, the next block boundary: a speculative step
        must not jump over it, or the state there would never exist."""
        if not req.started:
            self.plan_checkpoints(req, hit)
            done = hit
        else:
            done = req.num_computed
        for position in req.checkpoints:
            if position > done:
                return position
        if req.started and self.has_mamba and self.caching and self.policy.rolling \
                and done >= req.num_prompt_tokens:
            return (done // self.block_size + 1) * self.block_size
        return None

    # -- progress ------------------------------------------------------------
    def mark_computed(self, req: CacheRequest, num_tokens: int) -> None:
        n = req.num_computed + num_tokens
        req.num_computed = n
        if n < req.next_event:
            return  # decode fast path: no block completed, nothing leaves a window
        if self.caching:
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

    def fork(self, parent: CacheRequest, child: CacheRequest) -> None:
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.num_computed = parent.num_computed
        child.num_allocated = parent.num_allocated
        child.started = parent.started
        child.keys = list(parent.keys)
        child.checkpoints = list(parent.checkpoints)
        child.probation_at = parent.probation_at
        child.lookup = parent.lookup
        child.num_cached = list(parent.num_cached)
        child.num_released = list(parent.num_released)
        for manager in self.managers:
            manager.fork(parent, child)
        # Both now share the partly filled block: the next allocation of
        # either must take the slow path (copy on write).
        self._refresh(child)
        parent.steady = child.steady = False

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
        return _fixed_point(self._lookup_order, self.scan(req)[1], self.hit_limit(req)) * self.block_size

    def explain(self, req, hit):
        bs = self.block_size
        limit = self.hit_limit(req)
        masks = self.scan(req)[1]
        alone = [m.longest_hit(masks[m.index], limit) for m in self.managers]
        without = []
        for g in range(len(self.managers)):
            # Without group g the hit is at most the others' own best; if
            # that is the joint hit already, g changed nothing.
            bound = min((a for h, a in enumerate(alone) if h != g), default=limit)
            if bound * bs <= hit:
                without.append(hit)
            else:
                others = [m for m in self._lookup_order if m.index != g]
                without.append(_fixed_point(others, masks, bound) * bs)
        return [a * bs for a in alone], without


def _fixed_point(managers, masks: list[bytes], candidate: int) -> int:
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
