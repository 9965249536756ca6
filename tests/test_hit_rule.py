"""The coordinator's prefix hit against a brute-force reading of the rule,
written straight from the definitions: a hit of L tokens is valid iff every
group can serve it, and the answer is the largest valid L that is a
multiple of the block size and at most len(prompt) - 1."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.core import (ChunkedLocalSpec, FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec,
                           plan_layout)


def brute_force_hit(groups, cached, num_tokens, bs):
    """groups: list of (kind, param); cached[g]: block positions cached (for
    Mamba: token positions with a checkpoint)."""

    def valid(g, L):
        kind, param = groups[g]
        have = cached[g]
        if kind == "full":
            return all(j in have for j in range(L // bs))
        if kind == "window":
            return all(p // bs in have for p in range(max(0, L - param + 1), L))
        if kind == "chunked":
            return all(p // bs in have for p in range(param * (L // param), L))
        return L == 0 or L in have  # mamba

    return max(L for L in range(0, num_tokens, bs) if all(valid(g, L) for g in range(len(groups))))


def brute_force_subset(groups, cached, num_tokens, bs, keep):
    """The brute-force hit over the groups in `keep` only."""
    sub = [groups[g] for g in keep]
    return brute_force_hit(sub, [cached[g] for g in keep], num_tokens, bs)


def _spec(kind, param, index):
    # Distinct head counts keep each entry in its own group.
    heads = index + 1
    if kind == "full":
        return FullAttentionSpec(num_kv_heads=heads, head_size=4, dtype="float32")
    if kind == "window":
        return SlidingWindowSpec(num_kv_heads=heads, head_size=4, dtype="float32", sliding_window=param)
    if kind == "chunked":
        return ChunkedLocalSpec(num_kv_heads=heads, head_size=4, dtype="float32", chunk_size=param)
    return MambaSpec(shapes=((heads, 3), (heads, 2)), dtypes=("float32", "float32"))


group_strategy = st.tuples(st.sampled_from(["full", "window", "chunked", "mamba"]), st.integers(1, 24))


@settings(max_examples=1500, deadline=None)
@given(groups=st.lists(group_strategy, min_size=1, max_size=4), bs=st.sampled_from([1, 2, 4]),
       num_tokens=st.integers(1, 40), data=st.data())
def test_hybrid_hit_equals_brute_force_for_any_mix_of_types(groups, bs, num_tokens, data):
    # Mamba groups share one spec kind; keep at most one to stay in distinct groups.
    specs = {f"g{i}": _spec(kind, param, i) for i, (kind, param) in enumerate(groups)}
    # a pool of a few thousand pages: room for every block drawn, and
    # check_invariants (which walks every page) stays cheap
    layout = plan_layout(specs, 1 << 16, block_size=bs)
    assert len(layout.groups) == len(groups)
    kv = KVCacheManager(layout)
    prompt = data.draw(st.lists(st.integers(0, 5), min_size=num_tokens, max_size=num_tokens))
    kv.add_request("probe", prompt)
    req = kv._requests["probe"]
    num_blocks = num_tokens // bs
    kv.coordinator.extend_keys(req, num_blocks)
    cache = kv.block_cache
    cached = []
    for g, (kind, _) in enumerate(groups):
        width = layout.groups[g].pages_per_block
        if kind == "mamba":
            positions = data.draw(st.sets(st.integers(1, max(1, num_blocks)))) if num_blocks else set()
            positions = {p for p in positions if p <= num_blocks}
            for p in positions:
                block = cache.allocate([(width, 1)])[0][0]
                cache.store(g, [block], [req.keys[p - 1]])
                cache.release(block)
            cached.append({p * bs for p in positions})
        else:
            positions = data.draw(st.sets(st.integers(0, max(0, num_blocks - 1)))) if num_blocks else set()
            for j in positions:
                block = cache.allocate([(width, 1)])[0][0]
                cache.store(g, [block], [req.keys[j]])
                cache.release(block)
            cached.append(positions)
    expected = brute_force_hit(groups, cached, num_tokens, bs)
    assert kv.get_computed_tokens("probe") == expected
    # explain_hit: per group the hit it alone serves, and the joint hit of
    # the others (the limit when there are none), straight from the rule.
    why = kv.explain_hit("probe")
    assert why.hit_tokens == expected
    assert why.limit_tokens == (num_tokens - 1) // bs * bs
    everyone = range(len(groups))
    for g, part in enumerate(why.groups):
        assert part.alone_tokens == brute_force_subset(groups, cached, num_tokens, bs, [g])
        others = [h for h in everyone if h != g]
        assert part.without_tokens == brute_force_subset(groups, cached, num_tokens, bs, others)
        assert part.capped == (part.without_tokens > expected)
    # Taking the hit installs exactly the blocks the rule asks for.
    assert kv.allocate_slots("probe", num_tokens - expected)
    assert kv.get_computed_tokens("probe") == expected
    kv.check_invariants()


def test_hybrid_hit_is_zero_without_prefix_caching():
    specs = {"a": FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")}
    kv = KVCacheManager(plan_layout(specs, 1 << 20, block_size=2), enable_prefix_caching=False)
    for rid in ("x", "y"):
        kv.add_request(rid, [1, 2, 3, 4, 5])
        assert kv.get_computed_tokens(rid) == 0
        assert kv.allocate_slots(rid, 5)
        kv.mark_computed(rid, 5)
    assert kv.stats.hit_tokens == 0 and kv.stats.cached_blocks == 0
