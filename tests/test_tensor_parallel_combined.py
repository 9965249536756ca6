"""Tensor parallelism with the other features at once, on tiny Jamba:
speculative decoding whose drafts the model mostly rejects (every verified
step rolls the Mamba states back, on every rank, from the kept counts the
next plan carries), in a pool small enough to preempt, with chunked
prefill and Mamba checkpoint hits; and a host tier below each rank's pool
(each worker replays the driver's tier decisions on its own pool). The two
ranks' tokens equal the one process's and transformers' argmax.

And a disk tier below each rank's pool, alone or below a host tier (each
rank writes its own slices to its own files): hits served from disk, within one engine and after a
restart, give the one process's tokens; a block one rank cannot read
(truncated, missing, unreadable) is a miss on every rank, removed on every
rank, and recomputed with the same tokens."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.engine import speculative
from oracle import check_tokens, load_reference, model_dir, record_logits

LONGER = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    path = model_dir(tmp_path_factory, "jamba")
    return path, load_reference(path)


def prompts():
    shared = list(range(5, 40))
    return [shared + [41, 42], shared + [43], list(range(60, 90)), shared[:20] + list(range(100, 130)),
            list(range(150, 160)), shared + [44, 45, 46]]


def run(path, tp, **options):
    engine = Engine(path, progress=False, tensor_parallel_size=tp, **options)
    try:
        outs = engine.generate(prompts(), LONGER, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], engine.stats
    finally:
        engine.close()


def test_two_ranks_with_rejected_drafts_and_preemption_give_the_one_process_tokens(jamba, monkeypatch):
    path, reference = jamba
    # 16-token blocks: these short prompts share less than the planner's 64 for recurrent models.
    plain, _ = run(path, 1, max_num_batched_tokens=16, block_size=16)
    # Drafts the model rejects (it follows repetitions, so prompt lookup's own would all be kept).
    monkeypatch.setattr(speculative.PromptLookup, "propose",
                        lambda self, tokens, k: [(tokens[-1] * 7 + 3) % 211] * k)
    probe = Engine(path, progress=False, kv_cache_memory="8MiB", block_size=16)
    pages = 2 * probe.layout.pages_per_request(60, chunk=16) + 3  # room for about two requests at full length
    small = dict(kv_cache_memory=pages * probe.layout.page_size_bytes, max_num_batched_tokens=16, block_size=16,
                 speculative_method="ngram", num_speculative_tokens=3)
    one, one_stats = run(path, 1, **small)
    two, two_stats = run(path, 2, **small)
    assert one == plain and two == plain
    for prompt, tokens in zip(prompts(), two):
        check_tokens(reference, prompt, tokens)
    assert two_stats["preemptions"] > 0 and two_stats["spec_draft_tokens"] > 20
    assert two_stats["spec_accepted_tokens"] < two_stats["spec_draft_tokens"] / 2
    assert two_stats["prefix_hit_tokens"] > 0


def test_two_ranks_with_a_host_tier_serve_evicted_prefixes_with_the_one_process_logits(jamba):
    # Each rank's pool holds its half of the heads and channels, so the same
    # budget holds more blocks at two ranks: the steps differ, not the rows.
    # Every sampled row is compared by (sequence, position) with the one
    # process's: a block a worker loaded wrong would change its logits.
    path, reference = jamba
    docs = [[(11 * d + 5 * j) % 190 + 7 for j in range(44)] for d in range(4)]
    revisits = docs + [d + [3, 4] for d in docs]
    probe = Engine(path, progress=False, kv_cache_memory="8MiB", block_size=4, max_model_len=256)
    pages = 2 * probe.layout.pages_per_request(60, chunk=64) + 3  # every new document evicts the last
    options = dict(kv_cache_memory=pages * probe.layout.page_size_bytes, block_size=4, max_model_len=256,
                   max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for tp, tier in ((1, None), (1, "1MiB"), (2, "1MiB")):
        engine = Engine(path, progress=False, tensor_parallel_size=tp, kv_host_cache_memory=tier, **options)
        rows = record_logits(engine)
        try:
            outs = [engine.generate([p], params, use_tqdm=False)[0] for p in revisits]
            results[tp, tier] = ([o.outputs[0].token_ids for o in outs], engine.stats,
                                 {(seq_id, position): row for seq_id, position, row in rows})
        finally:
            engine.close()
    plain, tiered, two = results[1, None], results[1, "1MiB"], results[2, "1MiB"]
    assert tiered[0] == plain[0] and two[0] == plain[0]
    for prompt, tokens in zip(revisits, two[0]):
        check_tokens(reference, prompt, tokens)
    assert tiered[1]["kv_tier_loads_by_group"] and two[1]["kv_tier_loads_by_group"]  # hits served from host
    assert two[2].keys() == tiered[2].keys()
    for key, row in two[2].items():
        torch.testing.assert_close(row, tiered[2][key], atol=1e-4, rtol=1e-4)


def tier_options(path):
    # A pool for about two of these requests at one process; each rank's pool
    # holds its half of every block, so at two ranks the same bytes hold more.
    probe = Engine(path, progress=False, kv_cache_memory="8MiB", block_size=4, max_model_len=256)
    pages = 2 * probe.layout.pages_per_request(60, chunk=64) + 3
    return dict(kv_cache_memory=pages * probe.layout.page_size_bytes, block_size=4, max_model_len=256,
                max_num_batched_tokens=64)


def documents(n, length=44):
    return [[(11 * d + 5 * j) % 190 + 7 for j in range(length)] for d in range(n)]


SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def one_by_one(engine, prompts):
    """Each prompt after the last finished (so each evicts what came before):
    tokens and cached tokens."""
    outs = [engine.generate([p], SHORT, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.metrics.num_cached_tokens for o in outs]


def rank_directories(engine, directory):
    """The driver's disk tier directory, and the other ranks'."""
    mine = engine.tiers.disk.root
    return mine, [d for d in glob.glob(os.path.join(directory, "*")) if d != mine]


def block_files(root):
    """The block files under a rank's directory, as "g<group>/<key>.kv"."""
    return {os.path.relpath(name, root) for name in glob.glob(os.path.join(root, "g*", "*.kv"))
            if os.path.isfile(name)}


@pytest.fixture(scope="module")
def plain_tokens(jamba):
    """The one process's tokens (no tier) for every prompt the disk tests send."""
    path, _ = jamba
    docs = documents(6)
    prompts = docs + [d + [3, 4] for d in docs] + [d + [9, 9] for d in docs]
    engine = Engine(path, progress=False, **tier_options(path))
    tokens, _ = one_by_one(engine, prompts)
    return dict(zip(map(tuple, prompts), tokens))


@pytest.mark.parametrize("host", [None, "64KiB"])
def test_two_ranks_with_a_disk_tier_serve_hits_from_disk_after_a_restart_with_the_one_process_tokens(
        jamba, plain_tokens, tmp_path, host):
    # With a small host tier too, each rank's host memory pushes its oldest blocks to its own files.
    path, reference = jamba
    docs = documents(6)
    revisits = docs + [d + [3, 4] for d in docs]
    options = dict(tier_options(path), kv_host_cache_memory=host)
    engine = Engine(path, progress=False, tensor_parallel_size=2, kv_disk_cache=str(tmp_path), **options)
    try:
        tokens, _ = one_by_one(engine, revisits)
        assert tokens == [plain_tokens[tuple(p)] for p in revisits]
        assert sum(engine.stats["kv_tier_loads_by_group"]["disk"]) > 0, engine.stats  # hits within the run
        mine, others = rank_directories(engine, tmp_path)
    finally:
        engine.close()  # each rank writes what its pool still caches
    assert len(others) == 1 and glob.glob(os.path.join(others[0], "g*", "*.kv"))  # rank 1's own files
    restarted = Engine(path, progress=False, tensor_parallel_size=2, kv_disk_cache=str(tmp_path), **options)
    try:
        asked = [d + [9, 9] for d in docs[-2:]]
        tokens, cached = one_by_one(restarted, asked)
        assert tokens == [plain_tokens[tuple(p)] for p in asked]
        assert min(cached) >= 40, cached
        assert sum(restarted.stats["kv_tier_loads_by_group"]["disk"]) > 0
    finally:
        restarted.close()
    for prompt, generated in zip(asked, tokens):
        check_tokens(reference, prompt, generated)


def test_a_block_one_rank_cannot_read_is_a_miss_on_every_rank(jamba, plain_tokens, tmp_path):
    # Rank 1's files of the served documents are damaged two ways (cut
    # short, a directory where the file was: unreadable), rank 0's are
    # whole. The restarted engine's index holds them (by name, on every
    # rank), so its hit loads them: every load fails on rank 1 only, fails
    # on both ranks (both files removed), and the prompt is computed again
    # with the same tokens. (A file missing on one rank is not in the index
    # at all: tests/test_engine_tiers.py.)
    path, _ = jamba
    docs = documents(2)
    options = tier_options(path)
    engine = Engine(path, progress=False, tensor_parallel_size=2, kv_disk_cache=str(tmp_path), **options)
    try:
        one_by_one(engine, docs)
        mine, (theirs,) = rank_directories(engine, tmp_path)
    finally:
        engine.close()
    damaged = sorted(block_files(theirs))
    assert damaged
    for i, name in enumerate(os.path.join(theirs, n) for n in damaged):
        if i % 2 == 0:
            with open(name, "r+b") as f:
                f.truncate(os.path.getsize(name) // 2)
        else:
            os.unlink(name)
            os.mkdir(name)
    whole = block_files(mine)
    assert whole == set(damaged)  # the ranks wrote the same blocks
    restarted = Engine(path, progress=False, tensor_parallel_size=2, kv_disk_cache=str(tmp_path), **options)
    try:
        asked = [d + [9, 9] for d in docs]
        tokens, cached = one_by_one(restarted, asked[:1])
        # Checked before the next request, whose evictions may write these blocks again.
        left, theirs_left = block_files(mine), block_files(theirs)  # (directories: unreadable files)
        more_tokens, more_cached = one_by_one(restarted, asked[1:])
        stats = restarted.stats
    finally:
        restarted.close()
    assert tokens + more_tokens == [plain_tokens[tuple(p)] for p in asked]
    assert cached + more_cached == [0, 0]
    assert stats["kv_tier_failed_loads"] > 0 and stats["kv_tier_evictions"] > 0  # dropped what not all read
    assert not sum(stats["kv_tier_loads_by_group"].get("disk", [0]))
    read = whole - left
    assert read, "rank 0 kept every block whose read failed on rank 1"
    assert not read & theirs_left  # and rank 1 dropped them too
