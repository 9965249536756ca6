"""Prompt logprobs (SamplingParams.prompt_logprobs=k, vLLM's shape): for
every prompt position p >= 1, {token: logprob} holding the prompt's token at
p and the k most likely tokens there, equal to log_softmax of transformers'
logits (float32) under chunked prefill, batching beside ordinary requests,
window crossing and preemption, on both CPU backends; such a request takes
no prefix hit, and its blocks still serve others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.engine import plan_wire
from hybridkv.engine.sampling_params import MAX_LOGPROBS
from hybridkv.engine.step_plan import StepPlan
from oracle import load_reference, model_dir, reference_logits

CLOSE = 1e-4  # float32 logprobs: the engine's and transformers' logits agree to ~1e-6
WINDOW = 8


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return model_dir(tmp_path_factory, "gemma3", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(path):
    """transformers' log_softmax over a prompt's positions (memoised)."""
    model = load_reference(path)
    memo: dict[tuple, torch.Tensor] = {}

    def logprobs(prompt: list[int]) -> torch.Tensor:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = torch.log_softmax(reference_logits(model, prompt), dim=-1)
        return memo[tuple(prompt)]

    return logprobs


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 211, length).tolist()


def check(entries, tokens: list[int], k: int, expected: torch.Tensor) -> None:
    """vLLM's shape, each value transformers' log_softmax at the position
    before, the prompt's token first, then k tokens whose logprobs are the
    k largest (up to float rounding)."""
    assert len(entries) == len(tokens) and entries[0] is None
    for p in range(1, len(tokens)):
        row, entry = expected[p - 1], entries[p]
        ids = list(entry)
        assert ids[0] == tokens[p] and len(set(ids)) == len(ids)
        top = ids if len(ids) == k else ids[1:]  # the prompt's token is one of the top k, or comes on top
        assert len(top) == k, (p, entry)
        for token, value in entry.items():
            assert abs(value - row[token].item()) < CLOSE, (p, token, value, row[token].item())
        if k:
            kth = row.topk(k).values[-1].item()
            assert all(row[t].item() >= kth - CLOSE for t in top), (p, entry)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prompt_logprobs_equal_transformers_in_chunks_beside_ordinary_requests(path, reference, backend):
    # Chunks of 16 tokens over prompts of 70 and 45 (past the window of 8),
    # batched with two ordinary requests whose tokens stay what they are alone.
    engine = Engine(path, kv_cache_memory="16MiB", max_num_batched_tokens=16, backend=backend, dtype="float32",
                    progress=False)
    prompts = [prompt(70, 1), prompt(30, 2), prompt(45, 3), prompt(20, 4)]
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    params = [SamplingParams(**greedy, prompt_logprobs=5), SamplingParams(**greedy),
              SamplingParams(**greedy, prompt_logprobs=0, n=2), SamplingParams(**greedy)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    alone = engine.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert outs[2].outputs[1].token_ids == outs[2].outputs[0].token_ids  # n=2, greedy
    check(outs[0].prompt_logprobs, prompts[0], 5, reference(prompts[0]))
    check(outs[2].prompt_logprobs, prompts[2], 0, reference(prompts[2]))
    assert outs[1].prompt_logprobs is None and alone[0].prompt_logprobs is None
    assert engine.num_steps > 2 * 70 // 16  # the prompts took several chunks, twice
    assert all(route.startswith(f"{backend}:") for route in engine.stats["backend"]["routes"])
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_prompt_logprobs_take_no_prefix_hit_and_cache_for_others(path, reference):
    engine = Engine(path, kv_cache_memory="16MiB", dtype="float32", progress=False)
    tokens = prompt(64, 5)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([tokens], greedy, use_tqdm=False)  # caches the prompt's blocks
    asked = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    out = engine.generate([tokens], asked, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0  # every row computed
    check(out.prompt_logprobs, tokens, 2, reference(tokens))
    engine.kv.reset_prefix_cache()
    engine.generate([tokens], asked, use_tqdm=False)  # computed by the prompt-logprob request alone
    again = engine.generate([tokens + [7, 7]], greedy, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens == 64  # its blocks serve an ordinary request


def test_prompt_logprobs_under_preemption_are_recorded_once(path, reference):
    # A cache too small for the batch: the newest request, the prompt-logprob
    # one, is preempted in the middle of its prompt and computes it again;
    # each position has one entry, the first computation's.
    probe = Engine(path, kv_cache_memory="16MiB", dtype="float32", progress=False)
    layout = probe.layout
    chunk = 16
    prompts = [prompt(40, 6), prompt(40, 7), prompt(100, 8)]
    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    pages = layout.pages_per_request(100 + 30, chunk=chunk) + 4
    engine = Engine(path, kv_cache_memory=pages * layout.page_size_bytes, max_num_batched_tokens=chunk,
                    dtype="float32", progress=False)
    params = [SamplingParams(**greedy), SamplingParams(**greedy), SamplingParams(**greedy, prompt_logprobs=3)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert outs[2].metrics.num_preemptions > 0
    check(outs[2].prompt_logprobs, prompts[2], 3, reference(prompts[2]))
    alone = probe.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "3"])
def test_invalid_prompt_logprobs_are_a_clear_error(value):
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value)
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    assert SamplingParams().prompt_logprobs is None


def test_a_plan_with_prompt_logprob_rows_travels_whole(path):
    engine = Engine(path, kv_cache_memory="16MiB", progress=False)
    sent = StepPlan(ids=np.arange(6, dtype=np.int64), first_positions=np.array([0, 9], dtype=np.int64),
                    counts=np.array([5, 1], dtype=np.int64), rows=np.array([0, 1], dtype=np.int64), verifying=None,
                    sampled=np.array([4, 5], dtype=np.int64), logprob_rows=np.array([1, 2, 3], dtype=np.int64),
                    logprob_tokens=np.array([17, 3, 99], dtype=np.int64), logprob_top=4)
    got = plan_wire.decode(plan_wire.encode(sent), engine.layout)
    for name in ("ids", "sampled", "logprob_rows", "logprob_tokens"):
        assert np.array_equal(getattr(got, name), getattr(sent, name)), name
    assert got.logprob_top == 4
