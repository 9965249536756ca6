"""Tensor parallelism with the other features at once, on tiny Jamba:
speculative decoding whose drafts the model mostly rejects (every verified
step rolls the Mamba states back, on every rank, from the kept counts the
next plan carries), in a pool small enough to preempt, with chunked
prefill and Mamba checkpoint hits; and a host tier below each rank's pool
(each worker replays the driver's tier decisions on its own pool). The two
ranks' tokens equal the one process's and transformers' argmax."""

from __future__ import annotations

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
    plain, _ = run(path, 1, max_num_batched_tokens=16)
    # Drafts the model rejects (it follows repetitions, so prompt lookup's own would all be kept).
    monkeypatch.setattr(speculative.PromptLookup, "propose",
                        lambda self, tokens, k: [(tokens[-1] * 7 + 3) % 211] * k)
    probe = Engine(path, progress=False, kv_cache_memory="8MiB")
    pages = 2 * probe.layout.pages_per_request(60, chunk=16) + 3  # room for about two requests at full length
    small = dict(kv_cache_memory=pages * probe.layout.page_size_bytes, max_num_batched_tokens=16,
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
