"""KV events (core/events.py) and the prefix index a router holds
(core/prefix_index.py): fed a manager's events in order, the index gives
every probe prompt the hit the manager itself would give a fresh request,
for every layer mix, through evictions, forks, preemption, salts and
resets."""

import random

import pytest

from hybridkv.core import KVCacheManager
from hybridkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.core.prefix_index import PrefixIndex
from kv_shadow import FULL, MIXES, layer_specs, layout_for_requests, manager, random_workload, window


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_hybrid_prefix_index_fed_by_events_equals_the_managers_hit(mix):
    rng = random.Random(f"events-{mix}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=3, num_tokens=16)
    kv = KVCacheManager(layout, enable_kv_events=True)
    index = PrefixIndex(layout)
    seen = {"stored": 0, "removed": 0, "cleared": 0, "hits": 0, "probes": 0}
    probe_rng = random.Random(1)
    prompts: list[list[int]] = []

    def check(op):
        events = kv.take_events()
        for e in events:
            seen[{BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}[type(e)]] += 1
            if type(e) is BlockStored:  # a consumer can rebuild the keys from the parent and the tokens
                rebuilt = [e.parent_block_hash]
                kv.hasher.extend(rebuilt, None, [0] * e.block_size + e.token_ids, e.block_size,
                                 len(e.block_hashes) + 1)
                assert rebuilt[1:] == e.block_hashes, op
        index.apply("replica-0", events)
        for rid in list(kv._requests)[:2]:
            prompts.append(list(kv.token_ids(rid)))
        del prompts[:-20]
        for _ in range(2):
            base = probe_rng.choice(prompts) if prompts else [1, 2, 3]
            probe = base[:probe_rng.randrange(1, len(base) + 1)] + [probe_rng.randrange(100)]
            salt = probe_rng.choice([None, None, "other-tenant"])
            expected = _fresh_hit(kv, probe, salt)
            assert index.hit_tokens("replica-0", probe, cache_salt=salt) == expected, (op, probe, salt)
            seen["probes"] += 1
            seen["hits"] += expected > 0

    random_workload(kv, rng, num_ops=600, after_op=check)
    assert seen["stored"] > 20 and seen["removed"] > 5 and seen["hits"] > 20, seen


def _fresh_hit(kv, prompt, salt):
    kv.add_request("__probe__", prompt, cache_salt=salt)
    try:
        return kv.get_computed_tokens("__probe__")
    finally:
        kv.free("__probe__")


def test_events_are_off_unless_asked_and_then_report_runs_with_their_parent():
    kv = manager({"f": FULL, "w": window(6)}, pages=64)
    with pytest.raises(ValueError, match="enable_kv_events"):
        kv.take_events()
    kv = manager({"f": FULL, "w": window(6)}, pages=64, enable_kv_events=True)
    kv.add_request("a", list(range(1, 14)))  # 3 whole blocks of 4
    assert kv.allocate_slots("a", 13)
    kv.mark_computed("a", 13)
    events = kv.take_events()
    stored = [e for e in events if type(e) is BlockStored]
    assert {e.group_idx for e in stored} == {0, 1}
    keys = kv._requests["a"].keys
    for e in stored:
        assert e.block_hashes == keys[:3] and e.parent_block_hash == kv._requests["a"].root
        assert e.block_size == 4 and e.kind in ("full", "sliding_window") and e.token_ids == list(range(1, 13))
    assert kv.take_events() == []  # taken once
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_best_ranks_replicas_by_their_hybrid_hit():
    specs = {"f": FULL, "w": window(6)}
    layout = manager(specs).layout
    index = PrefixIndex(layout)
    prompt = list(range(1, 30))
    for name, share in (("short", 8), ("long", 24)):
        kv = KVCacheManager(layout, enable_kv_events=True)
        kv.add_request("a", prompt[:share] + [999])
        assert kv.allocate_slots("a", share + 1)
        kv.mark_computed("a", share + 1)
        index.apply(name, kv.take_events())
    assert index.best(prompt) == [(24, "long"), (8, "short")]
    index.remove_source("long")
    assert index.best(prompt) == [(8, "short")]


def test_engine_hands_over_its_managers_events():
    from hybridkv import Engine, SamplingParams
    from hybridkv.core.events import BlockStored
    from hybridkv.tiny_models import tiny_model_dir

    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", enable_kv_events=True, progress=False)
    engine.generate([list(range(3, 60))], SamplingParams(max_tokens=2), use_tqdm=False)
    events = engine.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and {e.group_idx for e in stored} == set(range(len(engine.layout.groups)))
    assert engine.take_kv_events() == []


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_best_over_several_sources_equals_each_managers_own_hit(mix):
    # best() computes every source's hit in one pass over the bitsets; each
    # must be what that source's manager gives a fresh request.
    rng = random.Random(f"best-{mix}")
    layout = layout_for_requests(layer_specs(MIXES[mix], window=7, chunk=10), num_requests=3, num_tokens=16)
    index = PrefixIndex(layout)
    managers = {name: KVCacheManager(layout, enable_kv_events=True) for name in ("a", "b", "c", "d")}
    prompts: list[list[int]] = []

    def feed(name):
        def after(op):
            kv = managers[name]
            index.apply(name, kv.take_events())
            prompts.extend(list(kv.token_ids(rid)) for rid in list(kv._requests)[:1])
        return after

    # a and b run the same workload, b stopping earlier: they share prefixes
    # and hold different parts of them; c runs its own; d is a again (ties).
    for name, seed, ops in (("a", mix, 150), ("b", mix, 70), ("c", f"{mix}-c", 150), ("d", mix, 150)):
        random_workload(managers[name], random.Random(seed), num_ops=ops, after_op=feed(name))
    checked = 0
    for _ in range(150):
        base = rng.choice(prompts)
        probe = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(100)]
        expected = {name: _fresh_hit(kv, probe, None) for name, kv in managers.items()}
        got = index.best(probe)
        assert dict((source, hit) for hit, source in got) == {n: h for n, h in expected.items() if h}
        assert [hit for hit, _ in got] == sorted((h for h in expected.values() if h), reverse=True)
        assert index.best_of_keys(index.block_keys(probe)[0]) == got  # a router's keys hashed once
        checked += len(got) > 1
    assert checked > 0  # some probes hit on several sources
