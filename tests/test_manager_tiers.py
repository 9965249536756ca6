"""A tier below the pool (core/tiers.py), on the manager alone: blocks the
pool evicts go to the tier, hits read it by the same rule as the pool, what
is loaded is exactly what was evicted, and a lost block is a miss."""

import random

import pytest

from hybridkv.core import KVCacheManager
from kv_shadow import MIXES, ShadowRunner, ShadowTier, layer_specs, layout_for_requests, random_workload


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_hybrid_tiered_random_workload_reads_only_own_tokens_and_leaks_nothing(mix):
    # The shadow tier keeps what evicted pages held and writes it back on a
    # load: every read of a loaded block is checked against the reader's own
    # tokens, and one fetch in ten finds its block gone (a corrupt file).
    rng = random.Random(f"tiers-{mix}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout)
    counts = random_workload(kv, rng, num_ops=1500, tier_blocks=40)
    assert counts["tier_puts"] >= 20 and counts["tier_loads"] >= 5, counts
    assert counts["tier_lost"] >= 1, counts
    assert sum(sum(n) for n in kv.stats.tier_loads.values()) == counts["tier_loads"]


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_prompt_evicted_from_the_pool_hits_in_full_from_the_tier(mix):
    specs = layer_specs(MIXES[mix], window=7, chunk=10)
    layout = layout_for_requests(specs, num_requests=2, num_tokens=40)

    def run(with_tier: bool) -> int:
        kv = KVCacheManager(layout)
        shadow = ShadowRunner(kv)
        if with_tier:
            kv.attach_tier(ShadowTier(shadow, len(layout.groups), capacity=10_000))
        prompt = list(range(1, 34))
        kv.add_request("a", prompt)
        assert shadow.run_prompt("a")
        kv.free("a")
        for i in range(12):  # others push every block of "a" out of the pool
            kv.add_request(f"o{i}", [100 + i] * 33)
            assert shadow.run_prompt(f"o{i}")
            kv.free(f"o{i}")
        kv.add_request("b", prompt + [7])
        hit = kv.get_computed_tokens("b")
        assert kv.allocate_slots("b", len(prompt) + 1 - hit)
        shadow.check_request("b")  # the loaded blocks hold "a"'s tokens
        shadow.compute("b", len(prompt) + 1 - hit)
        shadow.check_all()
        if with_tier and hit:
            assert kv.explain_hit("b").loaded_blocks
        return hit

    limit = (33 // 4) * 4  # whole blocks, one token left to compute
    hit = run(True)
    assert hit == limit or ("mamba" in mix and hit > 0), hit  # Mamba: the latest checkpoint at or before
    assert run(False) < hit  # the pool alone lost it (chunked local: all but the chunk boundaries)


def test_a_tier_needs_prefix_caching_and_a_trusted_hash():
    layout = layout_for_requests(layer_specs(("full",)), num_requests=1, num_tokens=16)
    shadow_kv = KVCacheManager(layout, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        shadow_kv.attach_tier(ShadowTier(ShadowRunner(shadow_kv), 1, 10))
    kv = KVCacheManager(layout, hash_function="builtin")
    with pytest.raises(ValueError, match="trusted hash"):
        kv.attach_tier(ShadowTier(ShadowRunner(kv), 1, 10))
