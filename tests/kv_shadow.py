"""Test helpers: tiny layouts of every layer-type mix, and a shadow runner
that plays the model for a KVCacheManager and proves that every block a
request reads holds exactly its own tokens."""

from __future__ import annotations

from hybridkv.core import (ChunkedLocalSpec, FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec,
                           plan_layout)

MIXES = {
    "full": ("full",),
    "window": ("window",),
    "chunked": ("chunked",),
    "mamba": ("mamba",),
    "full+window": ("full", "window"),
    "full+mamba": ("full", "mamba"),
    "full+window+mamba": ("full", "window", "mamba"),
    "window+chunked": ("window", "chunked"),
}


def layer_specs(kinds, window=7, chunk=10, layers_per_kind=(2, 3, 1)):
    """Tiny specs: one entry per kind, with uneven layer counts so that blocks
    span several pages."""
    specs = {}
    for i, kind in enumerate(kinds):
        count = layers_per_kind[i % len(layers_per_kind)]
        for layer in range(count):
            name = f"{kind}.{layer}"
            if kind == "full":
                specs[name] = FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")
            elif kind == "window":
                specs[name] = SlidingWindowSpec(num_kv_heads=1, head_size=4, dtype="float32", sliding_window=window)
            elif kind == "chunked":
                specs[name] = ChunkedLocalSpec(num_kv_heads=1, head_size=4, dtype="float32", chunk_size=chunk)
            else:
                specs[name] = MambaSpec(shapes=((6, 3), (6, 4)), dtypes=("float32", "float32"))
    return specs


def layout_with_pages(specs, num_pages, block_size=4):
    probe = plan_layout(specs, 1 << 30, block_size=block_size)
    return plan_layout(specs, probe.page_size_bytes * num_pages, block_size=block_size)


# One-layer specs for rule tests (32 B per token of KV; a 112 B Mamba state).
FULL = FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")
MAMBA = MambaSpec(shapes=((4, 3), (4, 4)), dtypes=("float32", "float32"))


def window(w):
    return SlidingWindowSpec(num_kv_heads=1, head_size=4, dtype="float32", sliding_window=w)


def manager(specs, pages=64, block_size=4, **kw):
    """A KVCacheManager over a pool of `pages` pages (the null page included)."""
    return KVCacheManager(layout_with_pages(specs, pages, block_size), **kw)


def layout_for_requests(specs, num_requests, num_tokens, block_size=4, chunk=12):
    """A pool that holds about `num_requests` requests of `num_tokens`."""
    probe = plan_layout(specs, 1 << 30, block_size=block_size)
    pages = 1 + num_requests * probe.pages_per_request(num_tokens, chunk)
    return plan_layout(specs, probe.page_size_bytes * pages, block_size=block_size)


class ShadowRunner:
    """Remembers, per page, the token prefix its KV (or state) was computed
    from, and checks every read against the reading request's own tokens."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.tier = None  # a ShadowTier below the pool, whose copies run before each forward pass
        self.recomputed = 0  # requests sent back to compute again (a tier load failed)
        self.content: dict[int, tuple] = {}
        self.checks = 0
        self.copies = 0
        self.prefix_of: dict = {}  # cache key -> the token prefix it stands for
        self.saved_inside = 0  # recurrent states written at checkpoints inside a chunk

    def apply_copies(self) -> None:
        for pairs in self.kv.take_copies().values():
            for src, dst in pairs:
                self.content[dst] = self.content.get(src)
                self.copies += 1

    def sync_tier(self) -> set[str]:
        """The tier copies the manager decided, as a worker makes them before
        a forward pass; the requests whose load failed start over (freed,
        added again with their tokens). Returns their ids."""
        if self.tier is None:
            return set()
        again = set(self.tier.copy())
        for rid in again:
            tokens = list(self.kv._requests[rid].tokens)
            self.kv.free(rid)
            self.kv.add_request(rid, tokens)
            self.recomputed += 1
        return again

    def compute(self, request_id: str, num_tokens: int) -> bool:
        """The forward pass over the next num_tokens (slots already allocated).
        False if a tier load it needed failed (it starts over instead)."""
        if not self._write(request_id, num_tokens, []):
            return False
        self.kv.mark_computed(request_id, num_tokens)
        self._learn_keys(request_id)
        return True

    def speculate(self, request_id: str, drafts: list[int], accepted: int, bonus: int) -> None:
        """A speculative step after allocate_slots(id, new, len(drafts)): the
        pass writes KV for the new tokens and every draft, the first
        `accepted` drafts join the request, then the sampled `bonus` token.
        As the contract says, the runner leaves in a Mamba write block the
        state after the last accepted token."""
        kv = self.kv
        req = kv._requests[request_id]
        new = len(req.tokens) - req.num_computed
        if not self._write(request_id, new, drafts, accepted):
            return
        kv.append_token_ids(request_id, drafts[:accepted])
        kv.mark_computed(request_id, new + accepted)
        kv.append_token_ids(request_id, [bonus])
        self._learn_keys(request_id)

    def _write(self, request_id: str, num_tokens: int, drafts: list[int], accepted: int = 0) -> bool:
        kv = self.kv
        if request_id in self.sync_tier():
            return False
        self.apply_copies()
        self.check_request(request_id)
        req = kv._requests[request_id]
        n, bs = req.num_computed, kv.block_size
        tokens = list(req.tokens[:n + num_tokens]) + list(drafts)
        end = n + num_tokens + len(drafts)
        # Checkpoints inside the chunk (checkpoints_inside_chunks): the pass
        # also leaves the state after each one's position in its pages.
        saving = kv.get_checkpoint_pages(request_id)
        for manager in kv.coordinator.managers:
            table = req.tables[manager.index]
            if manager.recurrent:
                read, write = table
                assert write, "a forward pass without a Mamba write block"
                for p in kv.block_cache.pages(write):
                    self.content[p] = tuple(tokens[:end - len(drafts) + accepted])
                for position, pages in saving.get(manager.index, ()):
                    assert n < position < n + num_tokens, f"{request_id}: a checkpoint outside its chunk"
                    self.saved_inside += 1
                    for p in pages:
                        self.content[p] = tuple(tokens[:position])
            else:
                for j in range(n // bs, -(-end // bs)):
                    block = table[j]
                    assert block, f"{request_id}: no block for new tokens at block {j}"
                    for p in kv.block_cache.pages(block):
                        # The slots written hold these tokens; a page record is
                        # the prefix its slots were computed from, drafts included.
                        self.content[p] = tuple(tokens[:min((j + 1) * bs, end)])
        return True

    def _learn_keys(self, request_id: str) -> None:
        req = self.kv._requests[request_id]
        bs = self.kv.block_size
        for j in range(min(len(req.keys), req.num_computed // bs)):
            self.prefix_of.setdefault(req.keys[j], tuple(req.tokens[:(j + 1) * bs]))

    def check_cached(self) -> None:
        """Every cached block (and copy) holds exactly the prefix its key
        stands for: nothing cached holds a rejected draft or a foreign KV."""
        pool = self.kv.block_cache
        if self.kv.hasher.verifies:
            return  # an untrusted hash: equal keys may stand for other prefixes (reads are still checked)
        for g, manager in enumerate(self.kv.coordinator.managers):
            entries = list(pool.cached[g].items())
            entries += [(key, block) for key, others in pool.copies[g].items() for block in others]
            for key, block in entries:
                prefix = self.prefix_of.get(key)
                if prefix is None:
                    continue
                for p in pool.pages(block):
                    got = self.content.get(p)
                    if manager.recurrent:
                        assert got == prefix, f"cached Mamba state {block} is not the state after its prefix"
                    else:
                        assert got is not None and got[:len(prefix)] == prefix and len(got) == len(prefix), (
                            f"cached block {block} of group {g} holds other tokens than its key")

    def check_request(self, request_id: str) -> None:
        kv = self.kv
        req = kv._requests[request_id]
        if not req.started:
            return
        n, bs, tokens = req.num_computed, kv.block_size, req.tokens
        for manager in kv.coordinator.managers:
            table = req.tables[manager.index]
            if manager.recurrent:
                read, write = table
                if n == 0:
                    assert not read, f"{request_id}: a state before any token"
                else:
                    assert read, f"{request_id}: no state after {n} tokens"
                    for p in kv.block_cache.pages(read):
                        assert self.content.get(p) == tuple(tokens[:n]), (
                            f"{request_id}: Mamba state page {p} holds another prefix")
                self.checks += 1
                continue
            first = manager.first_needed_block(n)
            for j, block in enumerate(table):
                if j * bs >= n:
                    break
                if j < first:
                    assert not block, f"{request_id}: block {j} kept past its window"
                    continue
                assert block, f"{request_id}: needed block {j} is null"
                expected = tuple(tokens[:min((j + 1) * bs, n)])
                for p in kv.block_cache.pages(block):
                    # Slots past the computed tokens (rejected drafts) are never read.
                    got = self.content.get(p)
                    assert got is not None and got[:len(expected)] == expected, (
                        f"{request_id}: group {manager.index} block {j} page {p} holds foreign KV")
            self.checks += 1

    def check_all(self) -> None:
        for request_id in list(self.kv._requests):
            self.check_request(request_id)
        self.check_cached()
        self.kv.check_invariants()

    def run_prompt(self, request_id: str, chunk: int = 1 << 30) -> bool:
        """Prefill the whole prompt in chunks (ending at checkpoints).
        False if the pool ran out (the request is left as it was)."""
        kv = self.kv
        while True:
            if kv._requests[request_id].started and kv.num_computed_tokens(request_id) >= kv.num_tokens(request_id):
                return True
            size = kv.next_chunk(request_id, chunk)
            if not kv.allocate_slots(request_id, size):
                return False
            self.compute(request_id, size)  # (a failed tier load: the loop starts it over)

    def decode(self, request_id: str, token: int) -> bool:
        kv = self.kv
        kv.append_token_ids(request_id, [token])
        if not kv.allocate_slots(request_id, 1):
            return False
        return self.compute(request_id, 1)


class ShadowTier:
    """Tiers below the pool for the shadow runner: the manager decides
    through the index (core/tiers.py `TierIndex`), and this plays the worker
    (`copy`): it keeps what the shadow says stored pages held, at most
    `capacity` blocks (LRU), writes loads back, and loses a block now and
    then (`loss`: the chance a load finds it gone, as a corrupt file would
    be), so a failed load must end in a recompute, never a wrong read."""

    def __init__(self, shadow: ShadowRunner, num_groups: int, capacity: int, rng=None, loss: float = 0.0):
        from collections import OrderedDict

        from hybridkv.core.tiers import TierIndex

        self.shadow, self.capacity, self.rng, self.loss = shadow, capacity, rng, loss
        self.index = TierIndex(num_groups, "shadow")
        self.blocks: OrderedDict = OrderedDict()  # (group, key) -> page contents
        self.puts = self.loads = self.lost = self.failed = 0
        shadow.tier = self

    def copy(self) -> list[str]:
        """Make the copies decided since the last call, in the plan's order;
        report; returns the requests that read a block whose load failed."""
        from hybridkv.core.tiers import TierReport

        plan = self.index.take()
        content = self.shadow.content
        moves, failed = [], []
        if plan.clear:
            self.blocks.clear()
        for store in plan.stores:
            self.puts += 1
            item = (store.group, store.key)
            self.blocks[item] = [content.get(p) for p in store.pages]
            self.blocks.move_to_end(item)
            moves.append((*item, "shadow"))
            while len(self.blocks) > self.capacity:
                moves.append((*self.blocks.popitem(last=False)[0], None))
        for i, load in enumerate(plan.loads):
            item = (load.group, load.key)
            got = self.blocks.get(item)
            if got is not None and self.rng is not None and self.rng.random() < self.loss:
                self.lost += 1
                del self.blocks[item]
                got = None
            if got is None:
                self.failed += 1
                failed.append(i)
                for page in load.pages:
                    content[page] = None  # what a failed load leaves: nothing a read may accept
                continue
            self.loads += 1
            for page, value in zip(load.pages, got):
                content[page] = value
        lost = self.index.reported(plan, TierReport(failed, moves))
        return self.shadow.kv.tier_loads_failed(lost) if lost else []


def random_workload(kv: KVCacheManager, rng, num_ops: int, check_every: int = 1, max_live: int = 8,
                    speculative: bool = False, tier_blocks: int | None = None, after_op=None) -> dict:
    """A seeded random mix of every manager operation, with heavy prefix
    sharing (a few system prompts, chat turns that extend earlier sequences,
    forks), checked by the shadow runner. `speculative`: decode steps also
    verify 1-4 draft tokens with lookahead slots and accept a random number
    of them. `tier_blocks`: a ShadowTier of that many blocks below the
    pool, which also loses one fetch in ten. `after_op(op)`: called after
    every operation. Returns event counts."""
    import collections

    shadow = ShadowRunner(kv)
    tier = None
    if tier_blocks is not None:
        tier = ShadowTier(shadow, len(kv.layout.groups), tier_blocks, rng, loss=0.1)
        kv.attach_tier(tier.index)
    counts = collections.Counter()
    systems = [[rng.randrange(100) for _ in range(rng.randrange(3, 20))] for _ in range(3)]
    history: list[list[int]] = []
    live: list[str] = []
    next_id = 0
    total = kv.num_free_pages
    for op in range(num_ops):
        choice = rng.random()
        if (choice < 0.22 and len(live) < max_live) or not live:
            if history and rng.random() < 0.4:
                prompt = list(rng.choice(history)) + [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
                counts["next_turn"] += 1
            else:
                prompt = list(rng.choice(systems)) + [rng.randrange(100) for _ in range(rng.randrange(1, 12))]
            rid = f"q{next_id}"
            next_id += 1
            kv.add_request(rid, prompt, cache_salt=rng.choice([None, None, None, "other-tenant"]))
            live.append(rid)
        elif choice < 0.80:
            rid = rng.choice(live)
            req = kv._requests[rid]
            if req.started and req.num_computed >= len(req.tokens):
                kv.append_token_ids(rid, [rng.randrange(100)])
            if speculative and req.started and len(req.tokens) - req.num_computed == 1 and rng.random() < 0.6:
                # A speculative decode step; it ends at the next checkpoint,
                # as an engine's does (kv.next_checkpoint).
                k = rng.randrange(1, 5)
                checkpoint = kv.next_checkpoint(rid)
                if checkpoint is not None:
                    k = min(k, checkpoint - req.num_computed - 1)
                drafts = [rng.randrange(100) for _ in range(k)]
                if kv.allocate_slots(rid, 1, num_lookahead=k):
                    accepted = rng.randrange(0, k + 1)
                    shadow.speculate(rid, drafts, accepted, rng.randrange(100))
                    counts["speculated"] += 1
                    counts["drafts"] += k
                    counts["accepted"] += accepted
                else:
                    counts["alloc_fail"] += 1
                if op % check_every == 0:
                    shadow.check_all()
                continue
            done = kv.get_computed_tokens(rid)
            size = kv.next_chunk(rid, rng.randrange(1, 12))
            started = req.started
            if kv.allocate_slots(rid, size):
                if not started and done:
                    counts["hits"] += 1
                    counts["hit_tokens"] += done
                if shadow.compute(rid, size):
                    counts["computed"] += 1
            else:
                counts["alloc_fail"] += 1
                if rng.random() < 0.5:  # preempt by recompute: free and start over
                    victim = rng.choice(live)
                    toks = list(kv._requests[victim].tokens)
                    kv.free(victim)
                    kv.add_request(victim, toks)
                    counts["preempted"] += 1
        elif choice < 0.86:
            rid = rng.choice(live)
            req = kv._requests[rid]
            if req.started and req.num_allocated == req.num_computed:
                child = f"q{next_id}"
                next_id += 1
                kv.fork(rid, child)
                live.append(child)
                counts["forks"] += 1
        elif choice < 0.995:
            rid = rng.choice(live)
            history.append(list(kv._requests[rid].tokens))
            if len(history) > 50:
                history.pop(0)
            kv.free(rid)
            live.remove(rid)
        else:
            kv.reset_prefix_cache()
        if op % check_every == 0:
            shadow.check_all()
            counts["checks"] += 1
        if after_op is not None:
            after_op(op)
    shadow.sync_tier()
    shadow.apply_copies()
    counts["copies"] = shadow.copies
    for rid in live:
        kv.free(rid)
    kv.check_invariants()
    assert kv.num_free_pages == total, "pages leaked after freeing every request"
    counts["evictions"] = kv.stats.evictions
    counts["block_checks"] = shadow.checks
    counts["saved_inside"] = shadow.saved_inside
    if tier is not None:
        counts.update(tier_puts=tier.puts, tier_loads=tier.loads, tier_lost=tier.lost,
                      tier_failed=tier.failed, recomputed=shadow.recomputed)
    return counts
