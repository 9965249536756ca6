"""The replica routing simulation (benchmarks/replica_routing.py) on tiny
layouts: the hybrid router's predicted hit is the chosen replica's real
hit; where sliding windows were evicted it picks replicas with a hit at
least as long as a token-prefix router's pick on the same state, which
mis-routes; round robin hits least. And the routing rule's affinity credit."""

import random

import pytest

from hybridkv.core.events import BlockRemoved, BlockStored
from hybridkv.core.prefix_index import PrefixIndex
from hybridkv.core.routing import RoutingRule
from benchmarks import replica_routing as sim
from kv_shadow import layer_specs, layout_for_requests

REPLICAS = 4


@pytest.fixture(scope="module")
def window_case():
    """Full attention + a 16-token window, pools of about 6 prompts of 600
    tokens, 300 requests of the benchmark's families at a twentieth of
    their lengths: windows get evicted while full blocks stay."""
    layout = layout_for_requests(layer_specs(["full", "window"], window=16), num_requests=6, num_tokens=600)
    workload = sim.make_workload(300, REPLICAS, 0.12, seed=0, shape=sim.WorkloadShape().small(0.05))
    return layout, workload


def run(layout, workload, name, **rule):
    if name == "hybrid (hit only)":
        router = sim.HybridRouter(layout, REPLICAS, RoutingRule(**rule, affinity=0.0), held=False)
    else:
        router = sim.make_router(name, layout, REPLICAS, **rule)
    return sim.simulate(layout, workload, router, REPLICAS)


@pytest.mark.parametrize("name", ["hybrid", "hybrid (hit only)"])
def test_the_hybrid_router_predicts_exactly_the_hit_the_chosen_replica_gives(window_case, name):
    layout, workload = window_case
    row = run(layout, workload, name)  # simulate() raises if one prediction is off
    assert row["predictions_checked"] == row["requests"] == len(workload)
    assert row["misroutes"] == 0 and row["misrouted_tokens"] == 0
    assert row["hit_tokens"] > 0


def test_where_windows_were_evicted_the_token_prefix_router_misroutes_and_the_hybrid_pick_hits_longer(window_case):
    layout, workload = window_case
    token = run(layout, workload, "token prefix")
    assert token["evicted_keys"]["sliding_window"] > 0
    assert token["misroutes"] > 0  # replicas held the full blocks but not the window tail
    # On the same states, with no queue price, the replica with the longest
    # real hit wins: the token-prefix pick never has a longer one.
    greedy = run(layout, workload, "hybrid (hit only)", queued_request_tokens=0)
    assert greedy["token_prefix_pick_longer"] == 0
    # With the default price, the evicted windows make the token-prefix
    # pick shorter far more often than longer (a busier replica can win).
    hybrid = run(layout, workload, "hybrid (hit only)")
    assert hybrid["evicted_keys"]["sliding_window"] > 0
    assert hybrid["token_prefix_pick_shorter"] > 2 * hybrid["token_prefix_pick_longer"]
    assert hybrid["hit_rate_at_routing"] > hybrid["hit_rate_at_token_prefix_pick"]


def test_round_robin_hits_least(window_case):
    layout, workload = window_case
    rates = {name: run(layout, workload, name)["hit_rate"] for name in ("round robin", "token prefix", "hybrid")}
    assert rates["round robin"] + 0.1 < min(rates["token prefix"], rates["hybrid"]), rates


def test_the_single_cache_gets_at_least_the_routed_replicas_hit_on_a_checkpointed_layout():
    layout = layout_for_requests(layer_specs(["full", "mamba"]), num_requests=6, num_tokens=600)
    single = layout_for_requests(layer_specs(["full", "mamba"]), num_requests=6 * REPLICAS, num_tokens=600)
    workload = sim.make_workload(200, REPLICAS, 0.12, seed=1, shape=sim.WorkloadShape().small(0.05))
    one = sim.run_router("single cache", layout, single, workload, REPLICAS, 64, 512)
    hybrid = sim.run_router("hybrid", layout, single, workload, REPLICAS, 64, 512)
    assert hybrid["predictions_checked"] == len(workload)
    assert hybrid["evicted_keys"]["mamba"] > 0
    assert one["hit_tokens"] >= hybrid["hit_tokens"] > 0


def test_held_tokens_are_the_leading_blocks_each_replica_holds():
    layout = layout_for_requests(layer_specs(["full", "window"]), num_requests=2, num_tokens=64)
    full = next(g for g, group in enumerate(layout.groups) if group.kind == "full")
    index = PrefixIndex(layout)
    rng = random.Random(0)
    keys = [f"k{i}" for i in range(12)]
    held = {r: set() for r in range(5)}
    for _ in range(300):
        r, key = rng.randrange(5), rng.choice(keys)
        group = rng.choice([full, 1 - full])  # the window group's keys are not the token-prefix view
        if rng.random() < 0.6:
            index.apply(r, [BlockStored([key], None, None, layout.block_size, group, "x")])
            held[r] |= {key} if group == full else set()
        else:
            index.apply(r, [BlockRemoved([key], group)])
            held[r] -= {key} if group == full else set()
        runs = index.held_tokens(keys)
        for replica, mine in held.items():
            n = 0
            while n < len(keys) and keys[n] in mine:
                n += 1
            assert runs.get(replica, 0) == n * layout.block_size


def test_the_affinity_credit_prefers_the_replica_holding_the_prefix_past_equal_hits():
    rule = RoutingRule(queued_request_tokens=100, affinity=0.25)
    # Equal hits, "b" one request busier but holding 800 tokens more of the
    # prompt: 0.25 * 800 = 200 > 100.
    assert rule.choose(1000, ["a", "b"], {"a": 100, "b": 100}, {"b": 1}, held={"b": 900}) == "b"
    # Without the held view, or with no credit, the queue wins.
    assert rule.choose(1000, ["a", "b"], {"a": 100, "b": 100}, {"b": 1}) == "a"
    assert RoutingRule(100, affinity=0.0).choose(1000, ["a", "b"], {"a": 100, "b": 100}, {"b": 1},
                                                 held={"b": 900}) == "a"
    # Held never counts below the hit, so a replica is not charged for it.
    assert rule.costs(1000, ["a"], {"a": 300}, {}, held={"a": 100}) == {"a": 700}
    with pytest.raises(ValueError, match="affinity"):
        RoutingRule(affinity=1.5)
