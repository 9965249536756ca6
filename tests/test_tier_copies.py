"""The tiers below the pool decide inside the scheduler and copy on the
worker (engine/kv_tiers.py): `put` and `load` only record copies, the
worker makes them in the order decided before the forward pass, a block
evicted and hit again in one step is loaded from its store's snapshot, and
the engine's outputs with tiers equal those without."""

from __future__ import annotations

import os
import threading

import torch

from hybridkv import Engine, FullAttentionSpec, SamplingParams, plan_layout
from hybridkv.core.tiers import TierRef
from hybridkv.engine.kv_tiers import TieredStore
from hybridkv.tiny_models import tiny_model_dir


def store(tmp_path=None, host=True):
    layout = plan_layout({"f": FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="float32")}, "64KiB",
                         block_size=4)
    pool = torch.zeros(layout.num_pages, layout.page_size_bytes, dtype=torch.uint8)
    page = layout.page_size_bytes
    tiers = TieredStore(pool, layout, host_bytes=8 * page if host else 0,
                        disk_dir=str(tmp_path) if tmp_path else None, disk_bytes=1 << 20, identity=b"i" * 32)
    return pool, tiers


def test_stores_and_loads_are_decided_first_and_copied_in_order():
    pool, tiers = store()
    pool[3] = 7
    tiers.put(0, b"k", [3])
    assert TierRef(0, b"k", "host") in tiers.index[0].values()  # decided: a lookup sees it now
    assert tiers.counters["stores"] == 0 and len(tiers.host.blocks) == 0  # nothing copied yet
    pool[3] = 9  # (not done: the step's forward would write page 3 only after the copies)
    copies = tiers.take_copies()
    assert tiers.take_copies() == []
    pool[3] = 7
    tiers.copy(copies)
    assert tiers.counters["stores"] == 1 and (0, b"k") in tiers.host
    content = tiers.fetch(tiers.index[0][b"k"])
    tiers.load([5], content)
    assert int(pool[5, 0]) == 0  # loads wait for the worker too
    tiers.copy(tiers.take_copies())
    assert torch.equal(pool[5], pool[3])


def test_a_block_evicted_and_hit_in_one_step_loads_from_its_stores_snapshot(tmp_path):
    for host in (True, False):
        pool, tiers = store(tmp_path / str(host), host=host)
        pool[2] = 5
        tiers.put(0, b"x", [2])  # evicted: page 2 goes to another block ...
        pool_before = pool.clone()
        tiers.load([2], torch.full((1, pool.shape[1]), 6, dtype=torch.uint8))  # ... loaded from a tier
        hit = tiers.fetch(tiers.index[0][b"x"])  # and the same step hits x again
        tiers.load([4], hit)
        tiers.copy(tiers.take_copies())
        assert torch.equal(pool[4], pool_before[2])  # x's content, not page 2's new one
        assert int(pool[2, 0]) == 6
        assert tiers.counters["loads"] == 1


def test_a_cleared_tier_does_not_keep_a_store_decided_before(tmp_path):
    pool, tiers = store(tmp_path)
    pool[1] = 3
    tiers.put(0, b"y", [1])
    tiers.clear()
    tiers.copy(tiers.take_copies())
    assert tiers.index[0] == {} and not tiers.host.blocks and not tiers.disk.files


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
            assert engine.tiers.copies == [] and not engine.tiers.storing  # every decided copy was made
            assert engine.stats["kv_tier_loads"] > 0
        engine.close()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert cached[1] > cached[0] and cached[2] > cached[0]


def copy_on_both(driver, worker) -> None:
    """Tensor parallelism: the driver makes its copies, the worker replays
    the driver's calls on its own pool and makes its own."""
    driver.copy(driver.take_copies())
    worker.replay(driver.take_log())
    worker.copy(worker.take_copies())


def test_a_worker_replaying_the_drivers_tier_calls_makes_the_same_copies():
    # Tensor parallelism: each rank's host tier replays the driver's calls on its own pool.
    (pool_a, driver), (pool_b, worker) = store(), store()
    driver.log = []
    pool_a[3], pool_b[3] = 7, 8  # each rank's own bytes of the same block
    driver.put(0, b"k", [3])
    copy_on_both(driver, worker)
    driver.load([5], driver.fetch(driver.index[0][b"k"]))
    copy_on_both(driver, worker)
    assert int(pool_a[5, 0]) == 7 and int(pool_b[5, 0]) == 8
    assert worker.host.blocks == driver.host.blocks and worker.index == driver.index


class Vote:
    """Two ranks' disk-read votes in one process (tensor_parallel.py's
    TensorParallelExecutor and Follower do it over torch.distributed): the driver's
    `ask` starts the worker's read on a thread, and `all` waits for both."""

    def __init__(self, rank: int, flags: list, barrier: threading.Barrier, worker=None):
        self.leads, self.rank, self.flags, self.barrier, self.worker = rank == 0, rank, flags, barrier, worker

    def ask(self, item):
        if self.leads:
            self.reading = threading.Thread(target=self.worker.read_agreed, args=(item,))
            self.reading.start()

    def all(self, ok: bool) -> bool:
        self.flags[self.rank] = ok
        self.barrier.wait()
        agreed = all(self.flags)
        self.barrier.wait()  # both have read the flags before either votes again
        if self.leads:
            self.reading.join()  # the worker has kept what it read, as a real one has before the next plan
        return agreed


def test_a_disk_read_counts_only_if_every_rank_read_its_file(tmp_path):
    # Tensor parallelism: two ranks' disk tiers, each with its own file of block k.
    (pool_a, driver), (pool_b, worker) = store(tmp_path / "0", host=False), store(tmp_path / "1", host=False)
    flags, barrier = [None, None], threading.Barrier(2, timeout=10)
    driver.log = []
    driver.agreement = Vote(0, flags, barrier, worker)
    worker.agreement = Vote(1, flags, barrier)
    for key in (b"k", b"m"):
        pool_a[3], pool_b[3] = 7, 8  # each rank's own bytes of the same block
        driver.put(0, key, [3])
        copy_on_both(driver, worker)
    # Both read k: a hit, each rank loading its own bytes.
    driver.load([5], driver.fetch(driver.index[0][b"k"]))
    copy_on_both(driver, worker)
    assert int(pool_a[5, 0]) == 7 and int(pool_b[5, 0]) == 8
    # The worker's file of m is gone: a miss on both, and both drop m.
    os.unlink(worker.disk._path(0, b"m"))
    assert driver.fetch(driver.index[0][b"m"]) is None
    assert b"m" not in driver.index[0] and (0, b"m") not in driver.disk.files
    assert not os.path.exists(driver.disk._path(0, b"m"))
    worker.replay(driver.take_log())  # the driver's failed fetch: nothing to load, no disagreement
    assert (0, b"m") not in worker.disk.files and worker.index == driver.index
