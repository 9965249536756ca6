"""A seeded random workload per layer-type mix, long enough that prefix
hits, allocation failures, preemption, forks and evictions all happen many
times; the shadow runner checks every read and the pool invariants after
every operation. (The soak in tests/test_reliability.py, `pytest -m soak`,
runs the same for 10^6 operations.)"""

import random

import pytest

from hybridkv.core import KVCacheManager
from kv_shadow import MIXES, layer_specs, layout_for_requests, random_workload


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("policy", ["hybridkv", "every_block"])
def test_hybrid_random_workload_reads_only_own_tokens_and_leaks_nothing(mix, policy):
    rng = random.Random(f"{mix}-{policy}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout, checkpoint_policy=policy)
    counts = random_workload(kv, rng, num_ops=1500)
    # The workload must really exercise the paths it claims to test.
    assert counts["hits"] >= 5, counts
    assert counts["alloc_fail"] >= 5, counts
    assert counts["forks"] >= 5, counts
    assert counts["evictions"] >= 5, counts


@pytest.mark.parametrize("mix", sorted(m for m in MIXES if "mamba" in m))
@pytest.mark.parametrize("policy", ["hybridkv", "every_block"])
def test_checkpoints_saved_inside_chunks_hold_the_state_at_their_position(mix, policy):
    # A backend that saves states inside prefill chunks: chunks run past
    # checkpoints, and every state the manager caches there must be the
    # state after exactly its position (the shadow writes each checkpoint's
    # pages with the prefix up to it, and checks every cached state and
    # every read against the request's own tokens).
    rng = random.Random(f"inside-{mix}-{policy}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=6, num_tokens=16)
    kv = KVCacheManager(layout, checkpoint_policy=policy, checkpoints_inside_chunks=True)
    counts = random_workload(kv, rng, num_ops=1500)
    assert counts["saved_inside"] >= 5, counts
    assert counts["hits"] >= 5 and counts["alloc_fail"] >= 5 and counts["evictions"] >= 5, counts
