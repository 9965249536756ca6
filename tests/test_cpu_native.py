"""The "cpu" backend: hybridkv's C decode attention (layers/cpu_kernels.c,
built by cpu_native.py, called by cpu_attention.py) against the torch
reference it replaces, and what happens where it cannot be built.

The engine-level oracle (tests/test_engine_oracle.py) runs through it as
well: "auto" picks it on the CPU, so its tokens and logits are checked
against transformers there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.core import FullAttentionSpec, SlidingWindowSpec
from hybridkv.layers import backend, cpu_attention, cpu_native, paged_attention
from hybridkv.layers.step import StepInputs, attention_step
from oracle import model_dir

needs_compiler = pytest.mark.skipif(cpu_native.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def native():
    lib = cpu_native.library()
    assert lib is not None, "a C compiler is on PATH, so the kernel must build"
    return cpu_attention.NativeAttention(lib)




@needs_compiler
@pytest.mark.parametrize("spec", [FullAttentionSpec(2, 80), SlidingWindowSpec(2, 80, sliding_window=7),
                                  FullAttentionSpec(1, 16), SlidingWindowSpec(3, 64, sliding_window=20)],
                         ids=["full-gqa3", "window-gqa3", "full-mha-like", "window-gqa2"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_decode_attention_matches_the_reference_on_a_scattered_pool(native, spec, softcap):
    gen = torch.Generator().manual_seed(1)
    bs, q_heads = 4, spec.num_kv_heads * (2 if spec.head_size == 64 else 3)
    lengths = np.array([1, 3, 4, 5, 17, 33, 40])  # tokens before each query, the query included
    blocks = int(-(-lengths.max() // bs))
    num_pages = 1 + len(lengths) * blocks
    # Every slot NaN until written: a kernel that reads a key outside a
    # query's range gets NaN in its output.
    cache = torch.full((num_pages, 2, bs, spec.num_kv_heads, spec.head_size), float("nan"))
    table = torch.zeros(1, len(lengths), blocks, dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0 is the null page
    for r, n in enumerate(lengths):
        used = -(-n // bs)
        table[0, r, :used] = order[r * blocks:r * blocks + used].to(torch.int32)
        for p in range(n):  # every key a query may read, and nothing else
            if p >= spec.first_visible(int(n - 1)):
                cache[table[0, r, p // bs], :, p % bs] = torch.randn(2, spec.num_kv_heads, spec.head_size,
                                                                     generator=gen)
    inputs = StepInputs.from_host(np.zeros(len(lengths), dtype=np.int64), lengths - 1, np.ones(len(lengths)),
                                  np.arange(len(lengths)), "cpu")
    step = attention_step(inputs, table, spec, bs)
    q = torch.randn(len(lengths), q_heads, spec.head_size, generator=gen)
    meta = native.build(step)
    assert isinstance(meta, cpu_attention.NativeMetadata)
    got = native.attend(q, cache, meta, 0, 0.2, softcap)
    reference_cache = torch.nan_to_num(cache)  # the reference masks what it gathers; NaN would survive its mask
    expected = paged_attention.attend(q, reference_cache, paged_attention.build(step), 0, 0.2, softcap)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@needs_compiler
def test_the_self_test_catches_a_wrong_kernel(native, monkeypatch):
    cpu_attention.check(native)
    monkeypatch.setattr(cpu_attention.NativeAttention, "attend_decodes",
                        lambda self, q, *args: torch.zeros_like(q))
    with pytest.raises(AssertionError):
        cpu_attention.check(native)


@needs_compiler
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "jamba"])
def test_engine_tokens_match_the_reference_backend(tmp_path_factory, family):
    # Decodes past Gemma's window of 8, Gemma-2's soft-capped attention,
    # Jamba's attention beside its Mamba layers; a mixed step (decodes with
    # a prefill chunk) and preemption in a small pool.
    path = model_dir(tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 23, 2, 37, 5))]

    def generate(name):
        engine = Engine(path, kv_cache_memory="96KiB", block_size=4, max_num_batched_tokens=16, progress=False,
                        backend=name)
        assert engine.backend.name == name
        bound = [m for m in engine.runner.model.modules() if getattr(m, "native", None) is not None]
        assert bool(bound) == (name == "cpu")  # the runner binds the C norms and activations with the backend
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.kv.num_free_pages == engine.kv.num_total_pages
        return [o.outputs[0].token_ids for o in outs]

    assert generate("cpu") == generate("torch")


@needs_compiler
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral"])
def test_decoder_layers_in_one_call_match_the_modules(tmp_path_factory, family, monkeypatch):
    # Every eager step runs twice from the same pool: through the modules
    # (MAX_ROWS 0), then through cpu_decoder's one call per layer; hidden
    # states and the pool must agree. The pool starts as NaN bytes, so a
    # slot the C layer should have zeroed (a fresh block's tail) or written
    # and did not shows up. Gemma-3: q/k norms, windows of 8 keys; Gemma-2:
    # soft-capped attention, no q/k norms; Mistral: no post norms, SiLU.
    from hybridkv.layers import cpu_decoder

    path = model_dir(tmp_path_factory, family)
    engine = Engine(path, kv_cache_memory="96KiB", block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                    progress=False, backend="cpu")
    model = engine.runner.model
    assert all(layer.native_decoder is not None for layer in model.model.layers)
    pool = engine.runner.buffers.pool
    pool.fill_(255)
    forward, rows_compared = model.forward, []

    def both(batch):
        before = pool.clone()
        monkeypatch.setattr(cpu_decoder, "MAX_ROWS", 0)
        expected, pool_after = forward(batch), pool.clone()
        monkeypatch.setattr(cpu_decoder, "MAX_ROWS", 4)
        if cpu_decoder.plan(batch, model.model.layers) is not None:
            rows_compared.append(len(batch.input_ids))
        pool.copy_(before)
        got = forward(batch)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(pool.view(torch.float32), pool_after.view(torch.float32), atol=2e-5, rtol=1e-4,
                                   equal_nan=True)
        return got

    monkeypatch.setattr(model, "forward", both)
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 4, 2, 7))]
    engine.generate(prompts, params, use_tqdm=False)
    engine.generate(prompts[:1], params, use_tqdm=False)
    assert {1, 4} <= set(rows_compared)  # decode steps of one row and of several ran through the C layer


@needs_compiler
def test_decoder_layers_are_bound_only_with_room_for_their_dense_weights(tmp_path_factory, monkeypatch):
    # A bound layer keeps its dense weights beside oneDNN's packed ones; with
    # no room, the layers stay on the modules, and the tokens are the same.
    from hybridkv.layers import cpu_decoder

    path = model_dir(tmp_path_factory, "gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7], [8, 2]]
    bound = Engine(path, kv_cache_memory="96KiB", block_size=4, progress=False, backend="cpu")
    monkeypatch.setattr(cpu_decoder, "spare_memory", lambda: 0)
    unbound = Engine(path, kv_cache_memory="96KiB", block_size=4, progress=False, backend="cpu")
    assert all(layer.native_decoder is not None for layer in bound.runner.model.model.layers)
    assert all(layer.native_decoder is None for layer in unbound.runner.model.model.layers)
    # The Linear layers read packed copies either way; the bound decoders hold the dense ones.
    assert all(m.weight.numel() == 0 for m in unbound.runner.model.model.layers[0].mlp.modules()
               if hasattr(m, "_packed") and m._packed is not None)
    assert [o.outputs[0].token_ids for o in bound.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in unbound.generate(prompts, params, use_tqdm=False)]


def test_without_a_compiler_auto_keeps_the_reference_and_cpu_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(backend, "_cpu", [])
    monkeypatch.setattr(cpu_native, "_loaded", {})
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang
    assert cpu_native.compiler() is None
    assert backend.choose("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="C compiler"):
        backend.choose("cpu", "cpu")


@needs_compiler
def test_a_failing_build_warns_and_keeps_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))
    monkeypatch.setattr(backend, "_cpu", [])
    monkeypatch.setattr(cpu_native, "_loaded", {})
    monkeypatch.setattr(cpu_native, "FLAGS", [*cpu_native.FLAGS, "-DNOT_A_FLAG", "-fno-such-option"])
    with pytest.warns(RuntimeWarning, match="building the CPU kernels failed"):
        assert backend.choose("auto", "cpu").name == "torch"
    assert not list((tmp_path / "native").iterdir())  # no half-built library left behind


def test_hybridkv_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    monkeypatch.setattr(backend, "_cpu", [])
    assert cpu_native.library() is None
    assert backend.choose("auto", "cpu").name == "torch"


@needs_compiler
def test_a_build_lands_under_one_name_per_source_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_loaded", {})
    assert cpu_native.library() is not None
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_native, "_loaded", {})
    assert cpu_native.library() is not None
    assert [p.name for p in (tmp_path / "native").iterdir()] == [built[0].name]
    assert built[0].stat().st_mtime_ns == stamp


@needs_compiler
@pytest.mark.parametrize("rows", [3, 700])  # one thread, and enough work for both
@pytest.mark.parametrize("dim", [40, 256, 72])  # remainders past the vector width
def test_fused_norms_and_rotary_match_torch(rows, dim):
    from hybridkv.layers import cpu_fused
    from hybridkv.layers.norm import RMSNorm
    from hybridkv.layers.rotary import apply_rotary

    lib = cpu_native.library()
    gen = torch.Generator().manual_seed(2)
    for unit_offset in (True, False):
        norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0.0 if unit_offset else 1.0))
        fused = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
        fused.load_state_dict(norm.state_dict())
        assert cpu_fused.configure(fused, lib) == 1
        packed = torch.randn(rows, 7 * dim, generator=gen) * 3
        heads = packed[:, dim:5 * dim].view(rows, 4, dim)  # strided, as q out of the fused q/k/v product
        cos, sin = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
        torch.testing.assert_close(fused(packed[:, :dim]), norm(packed[:, :dim]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused(heads), norm(heads), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.rotated(heads, cos, sin), apply_rotary(norm(heads), cos, sin),
                                   atol=2e-5, rtol=1e-5)
        assert norm.rotated(heads, cos, sin).shape == heads.shape  # the torch path of the same call


@needs_compiler
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,inter", [(2, 24), (300, 1000)])
def test_fused_gated_activation_matches_torch(activation, rows, inter):
    from hybridkv.layers import cpu_fused
    from hybridkv.modeling.sublayers import GatedMLP

    torch.manual_seed(3)
    mlp = GatedMLP(16, inter, activation)
    mlp.fuse()
    x = torch.randn(rows, 16) * 4  # gates far into both tails of the activation
    with torch.no_grad():
        expected = mlp(x)
        assert cpu_fused.configure(mlp, cpu_native.library()) == 1
        torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-4)
    erf = GatedMLP(16, inter, "gelu")
    erf.fuse()
    assert cpu_fused.configure(erf, cpu_native.library()) == 0  # GELU's erf form stays torch's
