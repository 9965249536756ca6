"""Tensor parallelism with the other features at once, on tiny Jamba:
speculative decoding whose drafts the model mostly rejects (every verified
step rolls the Mamba states back, on every rank, from the kept counts the
next plan carries), in a pool small enough to preempt, with chunked
prefill and Mamba checkpoint hits. The two ranks' tokens equal the one
process's and transformers' argmax."""

from __future__ import annotations

import pytest

from hybridkv import Engine, SamplingParams
from hybridkv.engine import speculative
from oracle import check_tokens, load_reference, model_dir

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
