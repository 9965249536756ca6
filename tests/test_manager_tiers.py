"""A tier below the pool (core/tiers.py), on the manager alone: blocks the
pool evicts go to the tier, hits read its index by the same rule as the
pool, what is loaded is exactly what was evicted, a lookup reads nothing,
and a load that fails sends its requests back to compute, never a wrong
read."""

import random

import pytest

from hybridkv.core import KVCacheManager
from kv_shadow import MIXES, ShadowRunner, ShadowTier, layer_specs, layout_for_requests, random_workload


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_hybrid_tiered_random_workload_reads_only_own_tokens_and_leaks_nothing(mix):
    # The shadow tier keeps what evicted pages held and writes it back on a
    # load: every read of a loaded block is checked against the reader's own
    # tokens, and one load in ten finds its block gone (a corrupt file): its
    # requests compute again.
    rng = random.Random(f"tiers-{mix}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout)
    counts = random_workload(kv, rng, num_ops=1500, tier_blocks=40)
    assert counts["tier_puts"] >= 20 and counts["tier_loads"] >= 5, counts
    assert counts["tier_lost"] >= 1 and 1 <= counts["recomputed"] <= counts["tier_failed"], counts
    assert sum(sum(n) for n in kv.stats.tier_loads.values()) == counts["tier_loads"]  # (failed ones uncounted)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_prompt_evicted_from_the_pool_hits_in_full_from_the_tier(mix):
    specs = layer_specs(MIXES[mix], window=7, chunk=10)
    layout = layout_for_requests(specs, num_requests=2, num_tokens=40)

    def run(with_tier: bool) -> int:
        kv = KVCacheManager(layout)
        shadow = ShadowRunner(kv)
        if with_tier:
            kv.attach_tier(ShadowTier(shadow, len(layout.groups), capacity=10_000).index)
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
        assert shadow.sync_tier() == set()  # the worker's copies, before the forward pass
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
        shadow_kv.attach_tier(ShadowTier(ShadowRunner(shadow_kv), 1, 10).index)
    kv = KVCacheManager(layout, hash_function="builtin")
    with pytest.raises(ValueError, match="trusted hash"):
        kv.attach_tier(ShadowTier(ShadowRunner(kv), 1, 10).index)


def evicted_prompt(mix="full+window+mamba"):
    """A manager with a shadow tier whose pool lost prompt "a" to others:
    (kv, shadow, tier, prompt)."""
    specs = layer_specs(MIXES[mix], window=7, chunk=10)
    kv = KVCacheManager(layout_for_requests(specs, num_requests=2, num_tokens=40))
    shadow = ShadowRunner(kv)
    tier = ShadowTier(shadow, len(kv.layout.groups), capacity=10_000)
    kv.attach_tier(tier.index)
    prompt = list(range(1, 34))
    kv.add_request("a", prompt)
    assert shadow.run_prompt("a")
    kv.free("a")
    for i in range(12):
        kv.add_request(f"o{i}", [100 + i] * 33)
        assert shadow.run_prompt(f"o{i}")
        kv.free(f"o{i}")
    shadow.sync_tier()
    return kv, shadow, tier, prompt


def test_a_lookup_changes_nothing_and_decides_no_copy():
    kv, shadow, tier, prompt = evicted_prompt()
    kv.add_request("b", prompt + [7])
    version = kv.block_cache.version
    first = kv.get_computed_tokens("b")
    tier.blocks.clear()  # the tier's storage loses everything between two lookups ...
    assert kv.get_computed_tokens("b") == first > 0  # ... which a lookup does not see: it reads the index only
    assert kv.block_cache.version == version and not tier.index.take()


def test_a_load_that_fails_sends_every_request_reading_its_block_back_to_compute():
    kv, shadow, tier, prompt = evicted_prompt()
    kv.add_request("b", prompt + [7])
    kv.add_request("c", prompt + [8])
    hit = kv.get_computed_tokens("b")
    assert kv.allocate_slots("b", len(prompt) + 1 - hit)
    assert kv.get_computed_tokens("c") == hit  # c shares b's loaded blocks, in the pool now
    assert kv.allocate_slots("c", len(prompt) + 1 - hit)
    tier.blocks.clear()  # every load of this step fails
    assert shadow.sync_tier() == {"b", "c"}
    assert sum(kv.stats.evictions_by_reason["lost"]) >= 1
    shadow.check_all()  # no cached block holds what a failed load left
    again = kv.get_computed_tokens("b")
    assert again < hit  # what is left of the hit: the pool lost the blocks, the index their keys
    assert shadow.run_prompt("b") and shadow.run_prompt("c")
    shadow.check_all()
