"""The Mamba-2 hybrids (Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1), LFM2's
short convolutions and the Gated DeltaNet of Qwen3-Next and Qwen3.5 in
hybridkv.Engine against transformers on the same tiny random weights
(tests/oracle.py: every config scalar that changes the math set away from
its neutral value, MoE where the family has one): greedy tokens are
argmaxes of one no-cache transformers forward and the logits of every step
are close, under batching with prefill chunks that end inside prompts and
at their ends, long prompts across the SSD and gated delta scans' chunks,
decode at fixed shapes, prefix hits on recurrent checkpoints (the state
read from the checkpoint equal to the one transformers reaches there),
preemption, speculative decoding's rollback of the recurrent states, and
the Triton backend (its kernels step the Mamba-2 and Gated DeltaNet states
it gathers; the short conv's run the reference's ops). `--device cuda` runs the engines on a GPU (transformers stays
on the CPU). `--dtype` does not apply here: these random tiny models drift
past any bfloat16 bound in transformers as much as in the engine, so the
cases run in float32 and one of them holds the engine in bfloat16 to
transformers in bfloat16."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from oracle import RECURRENT_FAMILIES, check_tokens, load_reference, model_dir, record_logits
from test_speculative_engine import assert_drafts_were_judged_both_ways, check_logits, quoting_prompts, record_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LOGIT_TOL = 2e-4
ENGINE = {}


@pytest.fixture(scope="module", autouse=True)
def engine_options(engine_device):
    ENGINE["device"] = engine_device


# Qwen3.5 differs from Qwen3-Next only in how its projections are stored
# and in its dense MLPs (the same mixer, attention and state handling): it
# runs the checkpoint-hit case (`any_family_model`), and as released (a
# multimodal Qwen3.5-MoE) a batch with prefill chunks ending inside prompts
# (the last test); every other family runs every case (`family_model`).
EVERY_CASE = [f for f in RECURRENT_FAMILIES if f != "qwen3_5"]
_built = {}


def _family(family, tmp_path_factory):
    if family not in _built:
        path = model_dir(tmp_path_factory, family)
        _built[family] = family, path, load_reference(path)
    return _built[family]


@pytest.fixture(scope="module", params=EVERY_CASE)
def family_model(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=RECURRENT_FAMILIES)
def any_family_model(request, tmp_path_factory):
    return _family(request.param, tmp_path_factory)


def make_engine(path, **kw):
    options = dict(kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=512, **ENGINE)
    options.update(kw)
    return Engine(path, **options)


def prompts(lengths, start=3):
    return [[(start + 7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate(lengths)]


def run_and_check(reference, path, prompt_list, params=GREEDY, **engine_kw):
    engine = make_engine(path, **engine_kw)
    records = record_logits(engine)
    outs = engine.generate(prompt_list, params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompt_list, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == params.max_tokens
        expected = check_tokens(reference, prompt, tokens)
        for seq_id, position, row in records:
            if seq_id == out.request_id:
                worst = max(worst, (row - expected[position]).abs().max().item())
    assert worst < LOGIT_TOL, f"max |logit diff| {worst}"
    assert engine.kv.num_free_pages == engine.kv.num_total_pages, "blocks leaked"
    return engine, outs


def test_hybrid_batch_with_prefill_chunks_ending_inside_prompts_matches_transformers(family_model):
    # A budget of 7 tokens a step: prefill chunks end inside the prompts and
    # at their ends, beside other sequences' decodes; states carried across.
    family, path, reference = family_model
    engine, _ = run_and_check(reference, path, prompts((37, 5, 21, 50, 2, 33)), max_num_batched_tokens=7)
    assert engine.num_steps > 25


def test_hybrid_long_prompts_cross_the_scan_chunks_with_fixed_shape_decode(family_model):
    # Prompts past two of the SSD scan's 64-token chunks in one prefill
    # step each, then decode steps at the bucketed fixed shapes.
    family, path, reference = family_model
    run_and_check(reference, path, prompts((150, 70, 9)), max_num_batched_tokens=1024, fixed_shape_decode=True)


def test_hybrid_bfloat16_engine_is_as_close_to_float32_as_transformers_in_bfloat16(family_model):
    # Random tiny models drift in bfloat16 (up to ~1.4 on a logit for
    # Qwen3-Next, in transformers as in the engine), so the engine in
    # bfloat16 is held to transformers in bfloat16: on the engine's own
    # sequences, across chunk boundaries, the SSD and gated delta scans'
    # chunks and decode, its logits are no further from float32 transformers'
    # than bfloat16 transformers' are (a state kept in the wrong dtype, or a
    # scale left in float32, shows here).
    import transformers

    family, path, reference = family_model
    half = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt_list = prompts((150, 37, 5))
    # The reference backend: the C modules round bfloat16 where torch's do
    # but sum in another order, which moves the tokens a random tiny model
    # generates, and on Granite's the worst logit of that sequence was 2.6x
    # transformers' error (0.079 vs 0.031; the same engine in float32 is
    # within 1e-4 of transformers, and a recurrent state kept in bfloat16
    # moved Granite's figure by less than that noise: 0.033).
    engine = make_engine(path, dtype="bfloat16", max_num_batched_tokens=16, backend="torch")
    records = record_logits(engine)
    outs = engine.generate(prompt_list, GREEDY, use_tqdm=False)
    ours = theirs = 0.0
    for prompt, out in zip(prompt_list, outs):
        sequence = torch.tensor([prompt + list(out.outputs[0].token_ids)])
        with torch.no_grad():
            exact, approx = reference(sequence).logits[0].float(), half(sequence).logits[0].float()
        rows = [(position, row) for seq_id, position, row in records if seq_id == out.request_id]
        assert len(rows) == GREEDY.max_tokens
        for position, row in rows:
            ours = max(ours, (row - exact[position]).abs().max().item())
            theirs = max(theirs, (approx[position] - exact[position]).abs().max().item())
    assert ours <= 1.5 * theirs + 0.02, f"bfloat16 engine {ours:.3f} vs transformers in bfloat16 {theirs:.3f}"
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _checkpoint_states(engine, prompt):
    """(hit, per recurrent layer the state parts its checkpoint holds) for a
    new request with `prompt`, read from the pool; the request is freed."""
    kv = engine.kv
    kv.add_request("probe", prompt)
    hit = kv.get_computed_tokens("probe")
    assert kv.allocate_slots("probe", len(prompt) - hit)
    states = {}
    buffers = engine.worker.buffers
    for g, (read, _write) in kv.get_state_pages("probe").items():
        flat = buffers.pool[torch.tensor(read)].reshape(1, -1)
        for name in engine.layout.groups[g].layer_names:
            states[name] = [part[0].float().cpu() for part in buffers.state_views(flat, name)]
    kv.free("probe")
    return hit, states


def _layer_index(name):
    return int(name.split(".")[2])


def test_hybrid_prefix_hit_serves_the_state_transformers_reaches(any_family_model):
    # A second turn hits the first's cached prefix, its recurrent layers
    # starting from a checkpoint: the checkpoint holds the conv window and
    # the SSM state that transformers' forward over the same prefix leaves
    # (the window's last K - 1 inputs), and the logits from there on are
    # transformers' own.
    family, path, reference = any_family_model
    engine = make_engine(path)
    records = record_logits(engine)
    first = prompts((30,))[0]
    out1 = engine.generate([first], GREEDY, use_tqdm=False)[0]
    second = first + out1.outputs[0].token_ids + [5, 6, 7]
    hit, states = _checkpoint_states(engine, second)
    assert hit >= 32 and hit % 4 == 0, hit
    with torch.no_grad():
        cache = reference(torch.tensor([second[:hit]]), use_cache=True).cache
    assert states
    for name, parts in states.items():
        layer = _layer_index(name)
        conv = cache.get_conv_state(layer)[0]
        torch.testing.assert_close(parts[0], conv[:, 1:].float(), atol=1e-5, rtol=1e-4)
        if len(parts) > 1:  # Mamba-2: [heads, head_dim, state]; Gated DeltaNet: [value heads, K, V]
            torch.testing.assert_close(parts[1], cache.get_recurrent_state(layer)[0].float(), atol=1e-5, rtol=1e-4)
    out2 = engine.generate([second], GREEDY, use_tqdm=False)[0]
    assert out2.metrics.num_cached_tokens == hit
    for prompt, out in ((first, out1), (second, out2)):
        expected = check_tokens(reference, prompt, out.outputs[0].token_ids)
        rows = [(pos, row) for seq_id, pos, row in records if seq_id == out.request_id]
        assert rows and max((row - expected[pos]).abs().max().item() for pos, row in rows) < LOGIT_TOL
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_hybrid_preemption_in_a_tiny_pool_keeps_outputs(family_model):
    family, path, reference = family_model
    prompt_list = prompts((26, 21, 29, 23))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ample = make_engine(path)
    expected = [o.outputs[0].token_ids for o in ample.generate(prompt_list, params, use_tqdm=False)]
    pages = 2 * ample.layout.pages_per_request(40, chunk=16) + 3
    small = make_engine(path, kv_cache_memory=pages * ample.layout.page_size_bytes, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in small.generate(prompt_list, params, use_tqdm=False)]
    assert small.stats["preemptions"] > 0
    assert got == expected
    for prompt, tokens in zip(prompt_list, got):
        check_tokens(reference, prompt, tokens)
    assert small.kv.num_free_pages == small.kv.num_total_pages


def test_hybrid_speculative_rollback_of_the_recurrent_states_matches_transformers(family_model):
    # Prompt-lookup drafts, some kept and some rejected: the recurrent
    # states go back to the last kept token (a state that saw a rejected
    # draft shows in the next rows' logits), with rolling checkpoints every
    # block, so a second turn still hits. The prompts quote the model's own
    # continuation of their start (random tiny models seldom repeat
    # themselves otherwise), so that drafts are found and often kept.
    family, path, reference = family_model
    plain = make_engine(path)
    starts = quoting_prompts(3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    said = [o.outputs[0].token_ids for o in plain.generate(starts, params, use_tqdm=False)]
    prompt_list = [start + continuation + start for start, continuation in zip(starts, said)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompt_list, params, use_tqdm=False)]
    engine = make_engine(path, speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    records = record_rows(engine)
    outs = engine.generate(prompt_list, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert check_logits(reference, prompt_list, outs, records, LOGIT_TOL) > 0  # (and every row after a rejection)
    assert_drafts_were_judged_both_ways(engine)
    second = [p + list(o.outputs[0].token_ids) + [9, 10] for p, o in zip(prompt_list, outs)]
    again = engine.generate(second, params, use_tqdm=False)
    assert all(o.metrics.num_cached_tokens > len(p) for o, p in zip(again, prompt_list))
    for prompt, out in zip(second, again):
        check_tokens(reference, prompt, out.outputs[0].token_ids)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_hybrid_triton_backend_matches_transformers(family_model):
    # Mamba-2's and Gated DeltaNet's states stepped by the Triton kernels
    # (gathered, in place); the short conv's by the reference's ops, said.
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    family, path, reference = family_model
    engine, _ = run_and_check(reference, path, prompts((13, 5, 9)), backend="triton", max_num_batched_tokens=16)
    assert engine.backend.name == "triton"
    declined = [line for line in engine.stats["backend"]["declined"] if "kernels for" in line]
    assert declined == (["triton kernels for short_conv layers (it has none): their states are gathered and "
                         "stepped by the reference's ops"] if family == "lfm2" else [])


def test_qwen3_5_moe_multimodal_checkpoint_serves_its_language_model(tmp_path_factory):
    # Qwen3.5 is released as a multimodal model: its language model's weights
    # under `model.language_model.`, a vision tower and MTP weights beside
    # them (skipped); this one with Qwen3.5-MoE's experts on every layer.
    import transformers

    path = model_dir(tmp_path_factory, "qwen3_5_moe_multimodal")
    reference = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    run_and_check(reference, path, prompts((37, 5, 80)), max_num_batched_tokens=16)
