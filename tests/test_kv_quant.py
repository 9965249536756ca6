"""Quantized KV pages (layers/kv_quant.py, docs/kv_dtypes.md): the codes
and per-token-head scales of int8 and float8 pages, their error bounds,
where the core counts their bytes, the layout they get, and attention over
them equal to attention over the values they stand for, through every
backend that declares them."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.core import FullAttentionSpec, SlidingWindowSpec, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.core.specs import kv_cache_dtypes, with_kv_cache_dtype
from hybridkv.layers import kv_quant
from hybridkv.layers.backends import choose
from hybridkv.layers.kv_buffers import KVBuffers
from hybridkv.layers.kv_quant import QuantizedCache, dequantize, quantize, rotation
from hybridkv.tiny_models import tiny_model_dir
from test_backend_conformance import BACKENDS, MIXED, SPECS, AttentionCase, backend

CODES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def rows(seed=0, n=64, dim=128):
    """Rows of very different magnitudes, outliers, exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    x[3, 17] = 1e4  # one outlier sets its row's scale
    x[5] = 0.0
    return x


@pytest.mark.parametrize("name", list(CODES))
def test_quantize_then_dequantize_stays_within_the_types_bound(name):
    x = rows()
    codes, scales = quantize(x, CODES[name])
    assert codes.dtype == CODES[name] and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    back = dequantize(codes, scales, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(scales, amax[:, 0] / kv_quant.code_max(CODES[name]))
    err = (back - x).abs()
    if name == "int8":  # half a step of amax / 127
        bound = amax / 254 * (1 + 1e-5)
    else:  # half an ulp of the element (3 or 2 mantissa bits), or of the smallest subnormal step
        mantissa, subnormal = {"float8_e4m3fn": (3, 2.0 ** -9), "float8_e5m2": (2, 2.0 ** -16)}[name]
        bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), scales[:, None] * subnormal / 2) * (1 + 1e-5)
    assert (err <= bound + 1e-30).all()
    # the largest element of each row is its top code times the scale: itself, to float32 rounding
    torch.testing.assert_close(back.abs().amax(-1), amax[:, 0], rtol=2.5e-7, atol=0)
    assert (back[5] == 0).all() and scales[5] == 0  # a row of zeros stays zeros
    assert torch.isfinite(back).all()


def test_a_spec_counts_the_scales_in_its_bytes_and_refuses_odd_rows():
    full = FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="int8")
    assert full.quantized and full.bytes_per_token == 2 * 8 * (128 + 4)
    assert full.code_bytes(16) == 2 * 16 * 8 * 128
    assert not FullAttentionSpec(8, 128, dtype="bfloat16").quantized
    with pytest.raises(ValueError, match="even head_size"):
        FullAttentionSpec(num_kv_heads=1, head_size=7, dtype="float8_e4m3fn")


def test_kv_cache_dtype_reads_one_dtype_or_one_per_kind():
    assert kv_cache_dtypes(None) == kv_cache_dtypes("auto") == dict.fromkeys(
        ("full", "sliding_window", "chunked_local"))
    assert kv_cache_dtypes("fp8") == dict.fromkeys(("full", "sliding_window", "chunked_local"), "float8_e4m3fn")
    assert kv_cache_dtypes({"full_attention": "int8", "sliding_window": "auto"}) == {
        "full": "int8", "sliding_window": None, "chunked_local": None}
    for bad, why in [("int4", "not a KV cache dtype"), ({"mamba": "int8"}, "unknown layer kind"),
                     (8, "a dtype name or a dict")]:
        with pytest.raises(ValueError, match=why):
            kv_cache_dtypes(bad)


def test_recurrent_states_are_never_quantized():
    config = load_config("models/nemotron-h-8b.json")
    specs = with_kv_cache_dtype(specs_from_config(config, dtype="bfloat16"), "int8")
    assert {s.dtype for s in specs.values() if not s.recurrent} == {"int8"}
    assert all(d in ("bfloat16", "float32") for s in specs.values() if s.recurrent for d in s.dtypes)
    with pytest.raises(ValueError, match="never quantized"):
        Engine(tiny_model_dir("tiny-gemma3"), recurrent_state_dtype="int8", progress=False)


@pytest.mark.parametrize("config", ["gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b", "nemotron-h-8b"])
def test_int8_pages_everywhere_hold_twice_the_tokens_of_bfloat16_ones(config):
    # One dtype on every attention layer keeps the planner's exact pages:
    # no rounding, so capacity follows the real bytes (the scales included).
    specs = specs_from_config(load_config(f"models/{config}.json"), dtype="bfloat16")
    wide, narrow = (plan_layout(with_kv_cache_dtype(specs, d), "80GiB") for d in ("auto", "int8"))
    for g in narrow.groups:
        if not g.recurrent:
            assert narrow.group_rounding_bytes(g) == 0
    attention = [s for s in specs.values() if not s.recurrent]
    exact = sum(s.bytes_per_token for s in attention) / sum(
        FullAttentionSpec(s.num_kv_heads, s.head_size, dtype="int8").bytes_per_token for s in attention)
    for tokens in (1024, 4096):
        ratio = narrow.max_requests(tokens) / wide.max_requests(tokens)
        if all(not s.recurrent for s in specs.values()):
            assert ratio == pytest.approx(exact, rel=0.02)
        else:  # a recurrent state per request is not narrowed
            assert 1.0 < ratio <= exact * 1.02


def test_attention_kinds_of_different_dtypes_get_the_page_of_least_rounding():
    specs = {f"l{i}": SlidingWindowSpec(16, 128, dtype="bfloat16", sliding_window=1024) for i in range(52)}
    specs.update({f"f{i}": FullAttentionSpec(16, 128, dtype="int8") for i in range(10)})
    layout = plan_layout(specs, "8GiB")
    used = sum(g.block_bytes for g in layout.groups)
    held = sum(g.pages_per_block for g in layout.groups) * layout.page_size_bytes
    assert (held - used) / held < 0.05  # the lcm page (4.3 MB) rounded the full group's blocks by 35%


# -- attention over quantized pages ------------------------------------------------------

def stand_for(x: torch.Tensor, codes_dtype: torch.dtype) -> torch.Tensor:
    """The values x is stored as in pages of `codes_dtype`: int8 rows
    rotated, quantized, widened and rotated back; float8 rows quantized
    and widened."""
    h = rotation(codes_dtype, x.shape[-1], x.device)
    if h is None:
        return dequantize(*quantize(x, codes_dtype), torch.float32)
    return dequantize(*quantize(x.float() @ h, codes_dtype), torch.float32) @ h


def quantized_case(case: AttentionCase, codes_dtype: torch.dtype):
    """The case's cache as a quantized layer's pages, and the float cache
    of the values those pages stand for (unseen slots finite garbage)."""
    gen = torch.Generator().manual_seed(7)
    cache = torch.where(case.cache.isnan(), torch.randn(case.cache.shape, generator=gen) * 1e3, case.cache)
    h = rotation(codes_dtype, cache.shape[-1], cache.device)
    codes, scales = quantize(cache if h is None else cache @ h, codes_dtype)
    values = dequantize(codes, scales, torch.float32)
    return QuantizedCache(codes, scales), values if h is None else values @ h


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flashinfer"])
@pytest.mark.parametrize("spec", ["full", "window-5", "chunked-24"])
@pytest.mark.parametrize("codes", list(CODES))
def test_attention_over_quantized_pages_equals_attention_over_their_values(name, spec, codes):
    b = backend(name)
    kv_spec = SPECS[spec]
    case = AttentionCase(kv_spec, MIXED, torch.float32, seed=3)
    quantized, values = quantized_case(case, CODES[codes])
    meta = b.attention.build(case.attention_step)
    b.attention.store(quantized, case.k, case.v, meta, 0)
    calls = []
    if name == "cpu":  # int8 and float8 decodes run in C
        real = b.attention.lib

        class Counted:  # the library, its decode attention's calls counted
            structs = real.structs

            def decode_attention(self, *args):
                calls.append(args)
                return real.decode_attention(*args)

            def __getattr__(self, name):
                return getattr(real, name)
        b.attention.lib = Counted()
    got = b.attention.attend(case.q, quantized, meta, 0, 0.25, None)
    assert len(calls) == (name == "cpu")
    # The same step over the values: the cached ones as the pages hold
    # them, the new K/V as the store quantized them.
    new_k = case.k
    case.cache = values
    case.k, case.v = stand_for(case.k, CODES[codes]), stand_for(case.v, CODES[codes])
    torch.testing.assert_close(got, case.dense(0.25, None), atol=3e-5, rtol=1e-4)
    # and the store wrote codes and scales where the new tokens live (int8: of the rotated rows)
    h = rotation(CODES[codes], new_k.shape[-1], "cpu")
    expected_codes, expected_scales = quantize(new_k if h is None else new_k @ h, CODES[codes])
    where = meta.reference if hasattr(meta, "reference") else meta.step if hasattr(meta, "step") else meta
    rows, offsets = where.store_pages[0], where.store_offsets
    assert torch.equal(quantized.codes[rows, 0, offsets].float(), expected_codes.float())
    torch.testing.assert_close(quantized.scales[rows, 0, offsets], expected_scales)


@pytest.mark.parametrize("codes", ["float8_e4m3fn", "float8_e5m2"])
def test_the_c_kernels_read_every_float8_code_as_torch_does(codes):
    # One key, its V row every finite code of the type (NaN and infinities,
    # never stored, as 0), scale 1: the output is the row the kernel widened.
    from hybridkv.layers.backends.cpu import kernels
    from hybridkv.layers.backends.cpu.attention import CpuAttention, CpuDecodes

    dtype = CODES[codes]
    every = torch.arange(256, dtype=torch.uint8)
    every[~every.view(dtype).float().isfinite()] = 0
    pool = torch.zeros(1, 2, 1, 1, 256, dtype=torch.uint8)
    pool[0, 1, 0, 0] = every
    scales = torch.tensor([0.0, 1.0]).view(1, 2, 1, 1)
    decodes = CpuDecodes(torch.arange(1), torch.zeros(1, 1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                         torch.zeros(1, dtype=torch.int64))
    out = CpuAttention(kernels()).attend_decodes(torch.ones(1, 1, 256), QuantizedCache(pool.view(dtype), scales),
                                                 decodes, 0, 1.0, None)
    assert torch.equal(out[0, 0], every.view(dtype).float())


def test_scales_stored_with_the_wrong_token_are_caught(monkeypatch):
    case = AttentionCase(SPECS["full"], MIXED, torch.float32, seed=3)
    quantized, values = quantized_case(case, torch.int8)
    b = choose("torch", "cpu")
    real = kv_quant.quantize

    def shifted(x, dtype):  # each new token stored with its neighbour's scale
        codes, scales = real(x, dtype)
        return codes, scales.roll(1, dims=0)
    monkeypatch.setattr("hybridkv.layers.backends.reference.attention.quantize", shifted)
    meta = b.attention.build(case.attention_step)
    b.attention.store(quantized, case.k, case.v, meta, 0)
    got = b.attention.attend(case.q, quantized, meta, 0, 0.25, None)
    case.cache = values
    case.k, case.v = stand_for(case.k, torch.int8), stand_for(case.v, torch.int8)
    assert not torch.allclose(got, case.dense(0.25, None), atol=3e-5, rtol=1e-4)


def test_the_pool_holds_codes_then_scales_in_each_layers_block():
    specs = {"a": FullAttentionSpec(2, 16, dtype="int8"), "b": FullAttentionSpec(2, 16, dtype="int8")}
    layout = plan_layout(specs, 1 << 20, block_size=4)
    buffers = KVBuffers(layout)
    a, b = buffers.attention_cache("a"), buffers.attention_cache("b")
    assert isinstance(a, QuantizedCache) and a.codes.shape[1:] == (2, 4, 2, 16) and a.scales.shape[1:] == (2, 4, 2)
    a.codes.fill_(3)
    a.scales.fill_(0.5)
    assert (b.codes == 0).all() and (b.scales == 0).all()  # layer a's bytes stay in layer a's part
    group = layout.groups[0]
    raw = buffers.pool[:, layout.layer_views["a"].offset:][:, :group.layer_bytes]
    assert (raw[:, :specs["a"].code_bytes(4)] == 3).all()
    assert (raw[:, specs["a"].code_bytes(4):].view(torch.float32) == 0.5).all()


# -- the engine ------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", {"full_attention": "int8"}],
                         ids=["int8", "fp8_e4m3", "full-int8"])
def test_an_engine_on_quantized_pages_says_so_and_serves_hits(kv_cache_dtype):
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", kv_cache_dtype=kv_cache_dtype,
                    progress=False, backend="cpu", dtype="float32")
    narrow = {g.spec.dtype for g in engine.layout.groups}
    assert narrow & {"int8", "float8_e4m3fn"}
    declined = " ".join(engine.stats["backend"]["declined"])
    # The C decode attention and the one-call layers read and write int8
    # and float8 pages: nothing falls back to the reference.
    assert "caches run the reference" not in declined and "pages run the modules" not in declined
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [(5 * j) % 200 + 3 for j in range(70)]
    first = engine.generate([prompt], params, use_tqdm=False)[0]
    again = engine.generate([prompt], params, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0  # a hit reads the pages as stored: the same codes, the same tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    routes = engine.stats["backend"]["routes"]
    if any(g.heads_per_page for g in engine.layout.groups):  # (full-int8: the sliding layers cut by heads)
        assert "cut by heads" in declined and "cpu:modules" in routes
    else:
        assert "cpu:decoder-layers" in routes


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_layers_cut_by_heads_attend_as_whole_ones(backend_name, monkeypatch):
    # int8 full layers beside float32 sliding ones: the planner packs the
    # sliding layers' heads, a page of one int8 layer holding half a
    # sliding layer's (core/layout.py); a step stores and reads each piece
    # apart and gives what whole layers give.
    def run():
        engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", progress=False, dtype="float32",
                        backend=backend_name, kv_cache_dtype={"full_attention": "int8"})
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        out = engine.generate([[(5 * j) % 200 + 3 for j in range(70)]], params, use_tqdm=False)[0]
        logprobs = [next(iter(p.values())) for p in out.prompt_logprobs[1:]]
        return [g.heads_per_page for g in engine.layout.groups], out.outputs[0].token_ids, logprobs

    packed, tokens, logprobs = run()
    monkeypatch.setattr("hybridkv.core.layout.PACKING_SLACK", float("inf"))  # the fewest packed groups: none
    whole, whole_tokens, whole_logprobs = run()
    assert packed == [1, 0] and whole == [0, 0]
    assert tokens == whole_tokens
    assert logprobs == pytest.approx(whole_logprobs, abs=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_layers_cut_into_uneven_pieces_attend_as_whole_ones(backend_name, tmp_path, monkeypatch):
    # Three KV heads a layer, pages of two: the sliding layers' heads go
    # 2 + 1, 1 + 2, ... across pages (core/layout.py), so a piece starts at
    # any head; each stores and reads its own heads and the query heads
    # that read them, and the tokens and logprobs are whole layers'.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import hybridkv.core.layout as layout_module

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=6, num_key_value_heads=3, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, max_position_embeddings=512,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"])
    Gemma3ForCausalLM(config).eval().save_pretrained(tmp_path)
    head = 2 * 16 * 16 * 4  # a float32 sliding layer's block, per KV head

    def run(packed: bool):
        with monkeypatch.context() as m:
            if packed:
                m.setattr(layout_module, "_packed_heads_page", lambda attn, states: (2 * head, [True, False]))
            else:
                m.setattr(layout_module, "PACKING_SLACK", float("inf"))
            engine = Engine(str(tmp_path), kv_cache_memory="4MiB", progress=False, dtype="float32",
                            backend=backend_name, kv_cache_dtype={"full_attention": "int8"})
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        out = engine.generate([[(5 * j) % 200 + 3 for j in range(40)]], params, use_tqdm=False)[0]
        logprobs = [next(iter(p.values())) for p in out.prompt_logprobs[1:]]
        pieces = [[heads for _, _, heads in engine.layout.layer_views[f"model.layers.{i}"].places]
                  for i in (0, 1, 3)]
        return pieces, out.outputs[0].token_ids, logprobs

    pieces, tokens, logprobs = run(packed=True)
    whole, whole_tokens, whole_logprobs = run(packed=False)
    assert pieces == [[2, 1], [1, 2], [2, 1]] and whole == [[0], [0], [0]]
    assert tokens == whole_tokens
    assert logprobs == pytest.approx(whole_logprobs, abs=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])  # Triton's kernels: its self-test (triton/check.py)
def test_scales_in_pages_of_their_own_attend_as_scales_beside_their_codes(backend_name, tmp_path, monkeypatch):
    # int8 full layers whose codes and scales the layout puts in different
    # pages of a block (core/layout.py `scales_apart`: gpt-oss-20b's page
    # of least rounding): six layers of three KV heads, codes four heads to
    # a page (pieces cut where one ends), scales 16 to a page (two pages);
    # every store and read finds each piece's scales through their own
    # column, and the tokens and logprobs are whole layers'.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import hybridkv.core.layout as layout_module

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=8,
                              num_attention_heads=6, num_key_value_heads=3, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, max_position_embeddings=512,
                              layer_types=["sliding_attention"] + ["full_attention"] * 3 + ["sliding_attention"]
                              + ["full_attention"] * 3)
    Gemma3ForCausalLM(config).eval().save_pretrained(tmp_path)
    page = 2 * 16 * 16 * 4  # one float32 sliding head's block: four int8 heads' codes, 16 heads' scales
    modes = [layout_module.PACKED, layout_module.SCALES_APART]

    def run(apart: bool):
        with monkeypatch.context() as m:
            if apart:
                m.setattr(layout_module, "_packed_heads_page", lambda attn, states: (page, modes))
            else:
                m.setattr(layout_module, "PACKING_SLACK", float("inf"))
            engine = Engine(str(tmp_path), kv_cache_memory="4MiB", progress=False, dtype="float32",
                            backend=backend_name, kv_cache_dtype={"full_attention": "int8"})
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        prompt = [(5 * j) % 200 + 3 for j in range(40)]
        out = engine.generate([prompt], params, use_tqdm=False)[0]
        # a hit reads the stored codes and scales (prompt logprobs read none)
        again = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                use_tqdm=False)[0]
        assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == out.outputs[0].token_ids
        logprobs = [next(iter(p.values())) for p in out.prompt_logprobs[1:]]
        return engine.layout, out.outputs[0].token_ids, logprobs

    layout, tokens, logprobs = run(apart=True)
    whole, whole_tokens, whole_logprobs = run(apart=False)
    full = layout.groups[1]
    assert full.scales_apart and full.pages_per_block == 5 + 2  # 18 heads: 5 pages of codes, 2 of scales
    assert [len(layout.layer_views[f"model.layers.{i}"].places) for i in (1, 2, 3)] == [1, 2, 2]
    assert {c for i in range(8) if i % 4 for c, _ in layout.layer_views[f"model.layers.{i}"].scale_runs} == {5, 6}
    assert not any(g.scales_apart for g in whole.groups)
    assert tokens == whole_tokens
    assert logprobs == pytest.approx(whole_logprobs, abs=1e-5)


@pytest.mark.parametrize("family", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_recurrent_hybrids_on_int8_pages_keep_float32_states_and_hit(family):
    # Gated DeltaNet and Mamba-2 beside int8 attention pages: the states
    # stay float32, the reference and the C kernels give the same tokens,
    # and a prompt sent again hits its checkpoint with the same tokens.
    prompt = [(7 * j) % 150 + 5 for j in range(140)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cpu"):
        engine = Engine(tiny_model_dir(family), kv_cache_memory="16MiB", kv_cache_dtype="int8", progress=False,
                        backend=backend, dtype="float32")
        dtypes = {d for g in engine.layout.groups for d in (g.spec.dtypes if g.recurrent else (g.spec.dtype,))}
        assert dtypes == {"float32", "int8"}, dtypes
        first = engine.generate([prompt], params, use_tqdm=False)[0]
        again = engine.generate([prompt], params, use_tqdm=False)[0]
        assert again.metrics.num_cached_tokens >= 128
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        tokens[backend] = first.outputs[0].token_ids
    assert tokens["torch"] == tokens["cpu"]


@pytest.mark.parametrize("dim", [64, 256])
def test_int8_decodes_in_c_stay_within_their_int16_steps(dim):
    # Rows of 64 and up read int8 pages with integer products where the CPU
    # has AVX-512 (kernels.c dot4_codes, weigh_codes): the queries and the
    # value weights in int16 steps, the weights stepped per block of 64
    # keys. Over ranges of 1 to 301 keys (blocks whole, cut, odd), each
    # output stays within what those steps can move it (check._int16_bound)
    # of attention over the values the pages stand for.
    from hybridkv.layers.backends.cpu import check
    from hybridkv.layers.backends.cpu.attention import CpuAttention, CpuDecodes

    lib = backend("cpu").attention.lib
    gen = torch.Generator().manual_seed(4)
    positions, firsts = [0, 63, 64, 200, 300, 310], [0, 0, 0, 1, 0, 150]
    counts = [p // 4 - f // 4 + 1 for p, f in zip(positions, firsts)]
    cache = torch.randn(sum(counts), 2, 4, 1, dim, generator=gen)  # each row's pages anywhere in the pool
    order, pages = torch.randperm(sum(counts), generator=gen), torch.zeros(len(counts), max(counts), dtype=torch.int64)
    for r, count in enumerate(counts):
        pages[r, :count] = order[sum(counts[:r]):sum(counts[:r + 1])]
    h = rotation(torch.int8, dim, "cpu")
    codes, scales = quantize((cache * torch.logspace(-1, 1, 4)[:, None, None]) @ h, torch.int8)
    q = torch.randn(len(positions), 4, dim, generator=gen) * torch.tensor([0.3, 1.0, 2.0, 4.0])[:, None]
    dec = CpuDecodes(torch.arange(len(positions)), pages[None], torch.tensor(firsts), torch.tensor(positions))
    got = CpuAttention(lib).attend_decodes(q, QuantizedCache(codes, scales), dec, 0, dim ** -0.5, None)
    values = dequantize(codes, scales, torch.float32) @ h
    expected = check._attention(q, values, pages, positions, firsts, dim ** -0.5, None, None)
    bound = 1e-5 + 2e-5 * expected.abs().max() + check._int16_bound(q @ h, codes, scales, pages, positions,
                                                                     firsts, dim ** -0.5)
    assert ((got - expected).abs() <= bound).all()
    # what the steps move is small beside what the int8 pages themselves hold (half a code step a row)
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()


def test_int8_pages_of_wide_heads_give_the_reference_backends_tokens(tmp_path):
    # Heads 64 wide: the C decodes over int8 pages take the integer
    # products; greedy tokens past several 64-key blocks are the torch
    # reference's (which reads the codes in float32).
    from oracle import build

    path = build("gemma3", str(tmp_path / "model"), sliding_window=96, head_dim=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((150, 67, 3))]

    def tokens(name):
        engine = Engine(path, kv_cache_memory="4MiB", kv_cache_dtype="int8", progress=False, backend=name,
                        dtype="float32")
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    assert tokens("cpu") == tokens("torch")


def test_int8_rows_are_stored_rotated_and_read_back_unchanged():
    # The rotation is orthonormal and its own inverse: attention over
    # rotated rows with rotated queries, rotated back, is attention over
    # the rows; and it spreads an outlier, so the other elements keep more
    # of their precision (the reason it is there).
    h = rotation(torch.int8, 64, "cpu")
    assert rotation(torch.float8_e4m3fn, 64, "cpu") is None and rotation(torch.int8, 80, "cpu") is None
    torch.testing.assert_close(h @ h, torch.eye(64), atol=1e-6, rtol=0)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    x[:, 5] *= 40.0  # one channel of outliers, as keys often have
    plain = (dequantize(*quantize(x, torch.int8), torch.float32) - x).norm()
    turned = (stand_for(x, torch.int8) - x).norm()
    assert turned < plain / 3


def test_the_page_dtype_is_part_of_the_cache_identity():
    # Tiers name their files by the identity: pages of one dtype are never
    # served to an engine of another, and the same dtype finds them again.
    from hybridkv.core.identity import kv_identity

    specs = {"a": FullAttentionSpec(2, 16), "b": SlidingWindowSpec(2, 16, sliding_window=8)}
    ids = {name: kv_identity(["weights"], "float32", plan_layout(with_kv_cache_dtype(specs, dtype), 1 << 20,
                                                                 block_size=4))
           for name, dtype in {"auto": "auto", "int8": "int8", "fp8": "fp8", "full int8": {"full": "int8"},
                               "int8 again": "int8"}.items()}
    assert ids["int8"] == ids["int8 again"]
    assert len({ids[n] for n in ("auto", "int8", "fp8", "full int8")}) == 4
    # the same pages with the scales apart from their codes (core/layout.py) are another format
    from dataclasses import replace

    layout = plan_layout(with_kv_cache_dtype(specs, "int8"), 1 << 20, block_size=4)
    apart = replace(layout, groups=tuple(replace(g, scales_apart=True) for g in layout.groups))
    assert kv_identity(["weights"], "float32", apart) != ids["int8"]
