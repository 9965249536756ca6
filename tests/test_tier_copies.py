"""The tiers below the pool decide inside the scheduler and copy on the
worker (core/tiers.py, engine/tier_copies.py): `put` and `load` only record
copies in the next plan, the worker makes them in the plan's order before
the forward pass (stores first: a block evicted and hit again in one step
is loaded from what its store kept), a load that fails is reported, with
its pages zeroed and its block dropped, and the engine's outputs with
tiers equal those without."""

from __future__ import annotations

import torch

from hybridkv import Engine, FullAttentionSpec, SamplingParams, plan_layout
from hybridkv.core.tiers import TierIndex, TierRef
from hybridkv.engine.tier_copies import copy_tiers
from hybridkv.tiers import TierStore
from hybridkv.tiny_models import tiny_model_dir


def store(tmp_path=None, host=True):
    layout = plan_layout({"f": FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="float32")}, "64KiB",
                         block_size=4)
    pool = torch.zeros(layout.num_pages, layout.page_size_bytes, dtype=torch.uint8)
    page = layout.page_size_bytes
    tiers = TierStore(page, 1, host_bytes=8 * page if host else 0,
                      disk_dir=str(tmp_path) if tmp_path else None, disk_bytes=1 << 20, identity=b"i" * 32)
    return pool, tiers, TierIndex(1, tiers.first_tier)


def test_stores_and_loads_are_decided_first_and_copied_in_order():
    pool, tiers, index = store()
    pool[3] = 7
    index.put(0, b"k", [3])
    assert index.index[0][b"k"] == TierRef(0, b"k", "host")  # decided: a lookup sees it now
    assert tiers.counters["stores"] == 0 and len(tiers.host.blocks) == 0  # nothing copied yet
    plan = index.take()
    assert not index.take()
    report = copy_tiers(tiers, pool, plan)
    assert tiers.counters["stores"] == 1 and (0, b"k") in tiers.host
    assert report.failed == [] and report.moves == [(0, b"k", "host")]
    index.load("r", index.index[0][b"k"], [5])
    assert int(pool[5, 0]) == 0  # loads wait for the worker too
    copy_tiers(tiers, pool, index.take())
    assert torch.equal(pool[5], pool[3])


def test_a_block_evicted_and_hit_in_one_step_loads_from_what_its_store_kept(tmp_path):
    for host in (True, False):
        pool, tiers, index = store(tmp_path / str(host), host=host)
        pool[1] = 6
        index.put(0, b"y", [1])
        copy_tiers(tiers, pool, index.take())  # y is in the tiers
        pool[2] = 5
        index.put(0, b"x", [2])  # evicted: page 2 goes to another block ...
        x = pool[2].clone()
        index.load("a", index.index[0][b"y"], [2])  # ... loaded from a tier
        index.load("b", index.index[0][b"x"], [4])  # and the same step hits x again
        report = copy_tiers(tiers, pool, index.take())
        assert report.failed == []
        assert torch.equal(pool[4], x)  # x's content, not page 2's new one
        assert int(pool[2, 0]) == 6


def test_a_cleared_tier_does_not_keep_a_store_decided_before(tmp_path):
    pool, tiers, index = store(tmp_path)
    pool[1] = 3
    index.put(0, b"y", [1])
    index.clear()
    copy_tiers(tiers, pool, index.take())
    assert index.index[0] == {} and not tiers.host.blocks and not tiers.disk.files


def test_a_load_whose_block_is_gone_fails_leaves_zeroed_pages_and_is_reported(tmp_path):
    pool, tiers, index = store(tmp_path, host=False)
    pool[1] = 3
    index.put(0, b"y", [1])
    copy_tiers(tiers, pool, index.take())
    with open(tiers.disk._path(0, b"y"), "r+b") as f:  # damaged after it was written
        f.truncate(10)
    pool[6] = 9
    index.load("r", index.index[0][b"y"], [6])
    plan = index.take()
    report = copy_tiers(tiers, pool, plan)
    assert report.failed == [0] and (0, b"y", None) in report.moves
    assert int(pool[6].abs().sum()) == 0 and not tiers.disk.files
    failed = index.reported(plan, report)
    assert [load.request_id for load in failed] == ["r"] and b"y" not in index.index[0]


def test_engine_outputs_with_tiers_equal_those_without(tmp_path):
    path = tiny_model_dir("tiny-jamba")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    docs = [[(11 * d + 5 * j) % 190 + 7 for j in range(44)] for d in range(4)]
    prompts = docs + [d + [3, 4] for d in docs]
    outputs, cached = [], []
    for tiers in ({}, {"kv_host_cache_memory": "1MiB"}, {"kv_disk_cache": str(tmp_path)}):
        probe = Engine(path, kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=256)
        pages = 2 * probe.layout.pages_per_request(60, chunk=64) + 3
        engine = Engine(path, kv_cache_memory=pages * probe.layout.page_size_bytes, block_size=4, progress=False,
                        max_model_len=256, max_num_batched_tokens=64, **tiers)
        outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
        outputs.append([o.outputs[0].token_ids for o in outs])
        cached.append(sum(o.metrics.num_cached_tokens for o in outs[len(docs):]))
        if engine.tiers is not None:
            assert not engine.tier_index.take()  # every decided copy was made
            assert engine.stats["kv_tier_loads"] > 0 and engine.stats["kv_tier_failed_loads"] == 0
        engine.close()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert cached[1] > cached[0] and cached[2] > cached[0]
