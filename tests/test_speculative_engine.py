"""Speculative decoding in the engine (prompt-lookup drafts): the drafter
and the acceptance rule alone, then the engine with speculation against the
engine without it and against transformers, on a sliding-window model whose
drafts cross the window and on a Mamba hybrid whose state must be rolled
back to the last accepted token: greedy outputs identical, the prefix hit
rate unchanged, under batching, preemption and prefix hits."""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.engine.seeding import engine_stream
from hybridkv.engine.speculative import PromptLookup, accept_drafts
from oracle import check_tokens, load_reference, model_dir, reference_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# -- the drafter --------------------------------------------------------------

def brute_force_drafts(tokens, k, low, high):
    """The longest suffix (high..low tokens) seen earlier; what followed its latest earlier occurrence."""
    end = len(tokens)
    for n in range(min(high, end), low - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_proposes_what_followed_the_latest_earlier_match():
    lookup = PromptLookup(min_n=1, max_n=3)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    # [5, 6, 7] occurred at 0 and 5; the latest (5) was followed by 1, 2, 5.
    assert lookup.propose(tokens, 3) == [1, 2, 5]
    assert PromptLookup(1, 3).propose([1, 2, 3], 4) == []  # nothing seen before
    assert PromptLookup(1, 3).propose([4, 4], 4) == [4]  # at most what is known after the match
    assert PromptLookup(2, 3).propose([1, 2, 3, 1], 4) == []  # a one-token match is below min_n
    assert PromptLookup(1, 3).propose([1, 2, 3, 1], 0) == []


def test_prompt_lookup_backs_off_after_steps_that_keep_no_draft():
    lookup = PromptLookup(1, 3)
    tokens = [1, 2, 3, 1, 2]
    assert lookup.propose(tokens, 2) == [3, 1]
    lookup.record(0)  # nothing kept: 2 steps without drafts
    assert [lookup.propose(tokens, 2) for _ in range(3)] == [[], [], [3, 1]]
    lookup.record(0)  # again: 4 steps
    assert [lookup.propose(tokens, 2) for _ in range(5)] == [[]] * 4 + [[3, 1]]
    lookup.record(1)  # a kept draft ends the back-off
    assert lookup.propose(tokens, 2) == [3, 1]
    lookup.record(0)
    assert [lookup.propose(tokens, 2) for _ in range(3)] == [[], [], [3, 1]]
    for _ in range(10):
        lookup.record(0)
    assert lookup.wait == PromptLookup.MAX_BACKOFF


def test_prompt_lookup_grown_token_by_token_equals_brute_force():
    rng = random.Random(0)
    for trial in range(30):
        low, high = rng.randint(1, 2), rng.randint(2, 4)
        lookup = PromptLookup(low, high)
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(1, 5))]
        for _ in range(60):
            k = rng.randint(1, 5)
            assert lookup.propose(tokens, k) == brute_force_drafts(tokens, k, low, high), (trial, tokens)
            tokens += [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]


# -- the acceptance rule --------------------------------------------------------

def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax_then_adds_one():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 4, 9, 2]):
        logits[row, best] = 1.0
    default = engine_stream(0)
    params = SamplingParams(temperature=0)
    assert accept_drafts(logits, [3, 4, 9], params, None, default) == [3, 4, 9, 2]  # all, then the bonus
    assert accept_drafts(logits, [3, 5, 9], params, None, default) == [3, 4]  # up to the first miss
    assert accept_drafts(logits, [0, 4, 9], params, None, default) == [3]
    logits[1, 0] = float("nan")
    assert accept_drafts(logits, [3, 4, 9], params, None, default) is None  # a row it needs is broken


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.7)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    # Whatever the draft, each emitted token is distributed as the target:
    # the first one (accepted draft or its replacement) and the second one.
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    vocab = logits.shape[1]
    from hybridkv.engine.sampler import _filtered_probabilities, _needs_sort

    probs, order = _filtered_probabilities(logits, [params] * 3, _needs_sort(params, vocab))
    if order is not None:
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
    gen = engine_stream(1)
    trials = 6000
    for drafts in ([0, 1], [int(probs[0].argmax()), int(probs[1].argmax())], [5, 5]):
        first = torch.zeros(vocab)
        second = torch.zeros(vocab)
        seconds = 0
        for _ in range(trials):
            out = accept_drafts(logits, drafts, params, None, gen)
            first[out[0]] += 1
            if out[0] == drafts[0]:  # the second token follows the first draft: target row 1
                second[out[1]] += 1
                seconds += 1
        assert (first / trials - probs[0]).abs().max() < 0.03, (drafts, first / trials, probs[0])
        if seconds > 1000:
            assert (second / seconds - probs[1]).abs().max() < 0.05, (drafts, second / seconds, probs[1])


# -- the engine ----------------------------------------------------------------

@pytest.fixture(scope="module", params=["gemma3", "jamba", "gpt_oss"])
def family_model(request, tmp_path_factory):
    # Gemma-3 and gpt-oss (attention sinks, experts) with a window of 8 and
    # blocks of 4: drafts cross the window and its block releases; Jamba
    # with rolling checkpoints every 4 tokens.
    path = model_dir(tmp_path_factory, request.param, sliding_window=8)
    return request.param, path, load_reference(path)


ENGINE = {}


@pytest.fixture(scope="module", autouse=True)
def engine_options(engine_device):
    ENGINE["device"] = engine_device  # --device cuda: the engines on a GPU, transformers on the CPU


def make_engine(path, speculative, **kw):
    options = dict(kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=512, **ENGINE)
    if speculative:
        options.update(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    options.update(kw)
    return Engine(path, **options)


def quoting_prompts(n=4, seed=0):
    """Prompts that repeat themselves, so that lookup finds drafts; and one that does not."""
    rng = random.Random(seed)
    out = []
    for i in range(n - 1):
        phrase = [rng.randint(3, 200) for _ in range(7 + i)]
        out.append(phrase * 3 + phrase[:2])
    out.append([rng.randint(3, 200) for _ in range(23)])
    return out


def generate(engine, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def record_rows(engine) -> list:
    """Spy on the engine's steps: (sequence id, position, the step's tokens
    up to that position, logits row) for every row sampled or verified."""
    records = []
    apply = engine._apply

    def spying(steps, logits):
        row = 0
        for s in steps:
            if s.drafts:
                tokens = s.seq.token_ids[s.start:s.start + 1] + s.drafts
                for j in range(s.count):
                    records.append((s.seq.seq_id, s.start + j, tokens[:j + 1], logits[row + j].float().cpu()))
                row += s.count
            elif s.completes:
                records.append((s.seq.seq_id, s.start + s.count - 1, [], logits[row].float().cpu()))
                row += 1
        return apply(steps, logits)

    engine._apply = spying
    return records


def check_logits(reference, prompts, outs, records, tolerance=2e-4) -> int:
    """Every row whose tokens are the final sequence's (a verified row after
    accepted drafts only) equals transformers' logits there: a Mamba state or
    a window that saw a rejected draft shows here even when the argmax
    survives it. Returns how many verified rows were checked."""
    checked = 0
    for prompt, out in zip(prompts, outs):
        final = prompt + list(out.outputs[0].token_ids)
        expected = reference_logits(reference, final)
        for seq_id, position, tokens, row in records:
            if seq_id != out.request_id or final[position + 1 - len(tokens):position + 1] != tokens:
                continue
            diff = (row - expected[position]).abs().max().item()
            assert diff < tolerance, f"{seq_id} position {position}: |logit diff| {diff}"
            checked += len(tokens) > 1
    return checked


def assert_drafts_were_judged_both_ways(engine):
    stats = engine.stats
    assert stats["spec_accepted_tokens"] > 0, stats
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"], stats  # some were rejected too


@pytest.mark.parametrize("fixed", [False, True], ids=["exact-decode", "fixed-decode"])
def test_hybrid_speculative_greedy_outputs_equal_plain_decoding(family_model, fixed):
    family, path, reference = family_model
    prompts = quoting_prompts()
    plain = generate(make_engine(path, False, fixed_shape_decode=fixed), prompts)
    engine = make_engine(path, True, fixed_shape_decode=fixed)
    records = record_rows(engine)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == plain
    for prompt, tokens in zip(prompts, got):
        check_tokens(reference, prompt, tokens)
    assert check_logits(reference, prompts, outs, records) > 4
    assert_drafts_were_judged_both_ways(engine)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages, "blocks leaked"


def test_hybrid_speculation_takes_fewer_steps_for_one_quoting_request(family_model):
    family, path, reference = family_model
    prompt = quoting_prompts()[:1]
    plain = make_engine(path, False)
    spec = make_engine(path, True)
    assert generate(spec, prompt) == generate(plain, prompt)
    assert spec.stats["steps"] < plain.stats["steps"], (spec.stats["steps"], plain.stats["steps"])
    assert spec.stats["spec_accepted_tokens"] == plain.stats["steps"] - spec.stats["steps"]


def test_hybrid_speculation_under_preemption_keeps_outputs(family_model):
    family, path, reference = family_model
    prompts = quoting_prompts(8, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = generate(make_engine(path, False), prompts, params)
    probe = make_engine(path, False).layout
    pages = 2 * probe.pages_per_request(70, chunk=16) + 3
    small = make_engine(path, True, kv_cache_memory=pages * probe.page_size_bytes, max_num_batched_tokens=16)
    records = record_rows(small)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert check_logits(reference, prompts, outs, records) > 0
    assert small.stats["preemptions"] > 0
    assert_drafts_were_judged_both_ways(small)
    assert small.kv.num_free_pages == small.kv.num_total_pages


def test_hybrid_speculation_keeps_the_prefix_hit_rate(family_model):
    # Two turns: the second prompt is the first, its answer and a question.
    # With speculation the same blocks and Mamba checkpoints exist, so the
    # second turn hits exactly as far, and the outputs are the same.
    family, path, reference = family_model
    first = quoting_prompts(3, seed=5)
    results = {}
    for speculative in (False, True):
        engine = make_engine(path, speculative)
        records = record_rows(engine)
        answers = generate(engine, first)
        second = [p + a + [9, 10, 11] for p, a in zip(first, answers)]
        outs = engine.generate(second, GREEDY, use_tqdm=False)
        answers2 = [o.outputs[0].token_ids for o in outs]
        stats = engine.stats
        results[speculative] = (answers, answers2, stats["prefix_hit_tokens"], stats["prefix_queried_tokens"])
        if speculative:
            assert_drafts_were_judged_both_ways(engine)
            check_logits(reference, second, outs, records)  # the second turn started from cached states
    assert results[True] == results[False]
    assert results[True][2] > 0


def test_speculation_stops_where_plain_decoding_stops(family_model):
    family, path, reference = family_model
    prompts = quoting_prompts(3, seed=7)
    plain_engine = make_engine(path, False)
    full = generate(plain_engine, prompts)
    # A stop token that plain decoding meets mid-way: speculation must stop
    # at the same token even when it arrives inside a run of accepted drafts.
    stop = full[0][len(full[0]) // 2]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], ignore_eos=True)
    spec_engine = make_engine(path, True)
    expected = [o.outputs[0] for o in plain_engine.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec_engine.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    for max_tokens in (1, 2, 7):  # max_tokens is never overshot by a verified step
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert generate(spec_engine, prompts, params) == [t[:max_tokens] for t in full]
    assert spec_engine.kv.num_free_pages == spec_engine.kv.num_total_pages


def test_hybrid_speculative_seeded_sampling_is_reproducible(family_model):
    family, path, reference = family_model
    params = SamplingParams(n=2, temperature=0.7, top_k=20, seed=11, max_tokens=30, ignore_eos=True)
    prompts = quoting_prompts(2, seed=9)[:1]
    a = [[c.token_ids for c in o.outputs] for o in make_engine(path, True).generate(prompts, params, use_tqdm=False)]
    b = [[c.token_ids for c in o.outputs] for o in make_engine(path, True).generate(prompts, params, use_tqdm=False)]
    assert a == b and all(len(t) == 30 for t in a[0])


def test_hybrid_speculative_triton_backend_matches_transformers(family_model):
    # The Triton backend keeps decode states in the pool and gathers the
    # verified chunks with the prefills: the rollback must work there too.
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    family, path, reference = family_model
    prompts = quoting_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = make_engine(path, True, backend="triton")
    records = record_rows(engine)
    outs = engine.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == generate(make_engine(path, False), prompts, params)
    for prompt, tokens in zip(prompts, got):
        check_tokens(reference, prompt, tokens)
    assert check_logits(reference, prompts, outs, records) > 0
    assert_drafts_were_judged_both_ways(engine)


def test_speculative_options_are_checked(family_model):
    family, path, reference = family_model
    with pytest.raises(ValueError, match="speculative_method"):
        make_engine(path, False, speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(path, False, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        make_engine(path, False, speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
