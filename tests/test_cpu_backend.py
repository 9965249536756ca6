"""The "cpu" backend (layers/backends/cpu): its C kernels against the torch
they replace, the whole-layer decode call against the modules, the typed
boundary read from the C source, and what happens where the kernels are
not built, do not load or fail their self-test.

The step-level cases every backend shares are in test_backend_conformance.py;
the engine-level oracle (test_engine_oracle.py) runs through this backend
too, since "auto" picks it on the CPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.core import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.layers import backends
from hybridkv.layers.backends import cpu
from hybridkv.layers.backends.cpu import build, check, decoder, library
from hybridkv.layers.backends.cpu.attention import CpuAttention, CpuMetadata
from hybridkv.layers.backends.cpu.modules import CpuGatedMLP, CpuRMSNorm
from hybridkv.layers.backends.reference import attention as reference
from hybridkv.layers.backends.swap import twin
from hybridkv.layers.step import StepInputs, attention_step
from oracle import model_dir

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture(scope="module")
def lib():
    return cpu.kernels()  # conftest.py built them for this source


@needs_compiler
@pytest.mark.parametrize("spec", [FullAttentionSpec(2, 80), SlidingWindowSpec(2, 80, sliding_window=7),
                                  FullAttentionSpec(1, 16), SlidingWindowSpec(3, 64, sliding_window=20)],
                         ids=["full-gqa3", "window-gqa3", "full-mha-like", "window-gqa2"])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_decode_attention_matches_the_reference_on_a_scattered_pool(lib, spec, softcap, sinks):
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
    sinks = torch.randn(q_heads, generator=gen) * 3 if sinks else None  # gpt-oss's attention sinks
    ops = CpuAttention(lib)
    meta = ops.build(step)
    assert isinstance(meta, CpuMetadata)
    got = ops.attend(q, cache, meta, 0, 0.2, softcap, sinks)
    reference_cache = torch.nan_to_num(cache)  # the reference masks what it gathers; NaN would survive its mask
    expected = reference.attend(q, reference_cache, reference.build(step), 0, 0.2, softcap, sinks)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("spec", [FullAttentionSpec(2, 64, dtype="bfloat16"),
                                  SlidingWindowSpec(1, 96, dtype="bfloat16", sliding_window=23),
                                  ChunkedLocalSpec(2, 64, dtype="bfloat16", chunk_size=24)],
                         ids=["full-gqa3", "window-gqa4", "chunked-gqa3"])
@pytest.mark.parametrize("bs", [4, 16])
def test_bfloat16_prefill_chunks_on_amx_tiles_match_float32_attention(lib, spec, bs):
    # Chunks of 37, 5 (after 21 cached keys), 70 (after 40) and 2 tokens and
    # a decode row, in one step over a scattered bfloat16 pool whose slots
    # past each sequence's last token are NaN (a read of one shows). Each
    # output is within one bfloat16 step of float32 attention over the same
    # values, plus 2^-9 of the largest value (the weights are rounded to
    # bfloat16 before the second product, as the tiles' path rounds them).
    if not lib.amx_prefill_attention:
        pytest.skip("no AMX tiles on this CPU: bfloat16 prefill chunks run the tiles' path (test_backend_conformance)")
    gen = torch.Generator().manual_seed(4)
    cached, counts = np.array([0, 21, 40, 9, 0]), np.array([37, 5, 70, 1, 2])
    blocks = int(-(-(cached + counts).max() // bs))
    num_pages = 1 + len(counts) * blocks
    cache = torch.full((num_pages, 2, bs, spec.num_kv_heads, spec.head_size), float("nan"), dtype=torch.bfloat16)
    table = torch.zeros(1, len(counts), blocks, dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    for r, n in enumerate(cached + counts):
        table[0, r, :-(-n // bs)] = order[r * blocks:r * blocks + -(-n // bs)].to(torch.int32)
        for p in range(n):
            cache[table[0, r, p // bs], :, p % bs] = torch.randn(2, spec.num_kv_heads, spec.head_size,
                                                                 generator=gen).bfloat16()
    inputs = StepInputs.from_host(np.zeros(counts.sum(), dtype=np.int64), cached, counts, np.arange(len(counts)),
                                  "cpu")
    step = attention_step(inputs, table, spec, bs)
    q_heads = spec.num_kv_heads * (3 if spec.num_kv_heads == 2 else 4)
    q = torch.randn(int(counts.sum()), q_heads, spec.head_size, generator=gen).bfloat16()
    ops = CpuAttention(lib)
    meta = ops.build(step)
    assert isinstance(meta, CpuMetadata) and meta.prefills is not None
    got = ops.attend(q, cache, meta, 0, 0.125)
    exact = reference.attend(q.float(), torch.nan_to_num(cache.float()), reference.build(step), 0, 0.125)
    assert not got.isnan().any()
    bound = check._steps(exact) + 2.0 ** -9 * torch.nan_to_num(cache.float()).abs().max()
    assert ((got.float() - exact).abs() <= bound).all(), (got.float() - exact).abs().max()


# -- the boundary and the self-test ------------------------------------------------
@needs_compiler
def test_the_boundary_is_read_from_the_c_source(lib):
    # The structs and signatures come from kernels.c; their sizes agree
    # with the compiled library's (checked at load).
    assert set(lib.structs) == {"paged_cache", "decode_rows", "prefill_rows", "decoder_layer"}
    assert set(lib.functions) == {"decode_attention", "norm_rotary", "gated_activation", "decode_layer",
                                  "layer_stage", "row_max", "head_products", "rotate_rows", "masked_softmax",
                                  "prefill_attention", "gated_delta", "ssd", "host_all_reduce",
                                  "struct_sizes"}
    restype, args = lib.functions["decode_attention"]
    assert restype is ctypes.c_int and args[0]._type_ is lib.structs["paged_cache"]
    assert [name for name, _ in lib.structs["paged_cache"]._fields_][:2] == ["data", "page_stride"]


@needs_compiler
def test_a_struct_that_differs_from_the_library_is_refused_at_load(monkeypatch):
    read = library.read_structs

    def one_field_short(source):
        structs = read(source)
        fields = structs["decoder_layer"]._fields_[:-1]
        structs["decoder_layer"] = type("decoder_layer", (ctypes.Structure,), {"_fields_": fields})
        return structs

    monkeypatch.setattr(library, "read_structs", one_field_short)
    with pytest.raises(ImportError, match="struct decoder_layer is .* bytes in C"):
        library.Kernels(build.built_library())


def library_with(lib, name: str, replace):
    """The library with its function `name` replaced by `replace(fn)`."""
    class StandIn:
        structs = lib.structs

        def __getattr__(self, attr):
            fn = getattr(lib, attr)
            return replace(fn) if attr == name else fn
    return StandIn()


@needs_compiler
@pytest.mark.parametrize("broken", ["decode_attention", "norm_rotary", "gated_activation", "decode_layer", "layer_stage",
                                    "row_max", "head_products", "rotate_rows", "masked_softmax", "gated_delta",
                                    "ssd"])
def test_the_self_test_covers_every_exported_function(lib, broken, monkeypatch):
    check.check(lib)
    if broken == "head_products" and not lib.native_bf16_products:
        pytest.skip("no bfloat16 dot product on this CPU: head_products refuses every call, and nothing calls it")

    def answering_zeros(fn):  # its first float output zeroed
        def wrong(*args):
            status = fn(*args)
            out = args[{"decode_attention": 7, "norm_rotary": 13, "gated_activation": 5, "decode_layer": 3,
                        "layer_stage": 3,
                        "row_max": 4, "head_products": 5, "rotate_rows": 0, "masked_softmax": 9, "gated_delta": 15,
                        "ssd": 16}[broken]]
            ctypes.memset(out if isinstance(out, int) else ctypes.addressof(out), 0, 4)
            return status
        return wrong

    with pytest.raises(AssertionError, match=broken):
        check.check(library_with(lib, broken, answering_zeros))


@needs_compiler
@pytest.mark.parametrize("broken", ["decode_attention", "decode_layer"])
def test_the_self_test_catches_attention_sinks_ignored(lib, broken):
    def reading_no_sinks(fn):
        def wrong(*args):
            if broken == "decode_attention":
                return fn(*args[:6], None, *args[7:])
            layer = type(args[0]).from_buffer_copy(args[0])
            layer.sinks = None
            return fn(layer, *args[1:])
        return wrong

    with pytest.raises(AssertionError, match=broken):
        check.check(library_with(lib, broken, reading_no_sinks))


# -- the engine through it ------------------------------------------------------------
@needs_compiler
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "jamba", "gpt_oss"])
def test_engine_tokens_match_the_reference_backend(tmp_path_factory, family):
    # Decodes past Gemma's window of 8, Gemma-2's soft-capped attention,
    # Jamba's attention beside its Mamba layers, gpt-oss's attention sinks
    # in the C decode kernel (its experts keep its layers off the one-call
    # path, which the report says); a mixed step (decodes with a prefill
    # chunk) and preemption in a small pool.
    path = model_dir(tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 23, 2, 37, 5))]

    def generate(name):
        engine = Engine(path, kv_cache_memory="96KiB", block_size=4, max_num_batched_tokens=16, progress=False,
                        backend=name)
        assert engine.backend.name == name
        swapped = [m for m in engine.worker.model.modules() if isinstance(m, (CpuRMSNorm, CpuGatedMLP))]
        assert bool(swapped) == (name == "cpu")  # the backend swapped in its modules when it prepared the model
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.kv.num_free_pages == engine.kv.num_total_pages
        routes = engine.stats["backend"]["routes"]
        assert sum(routes.values()) == engine.stats["steps"] and all(r.startswith(name + ":") for r in routes)
        if family == "gpt_oss" and name == "cpu":
            assert "one-call decoder layers: a mixture-of-experts feed-forward" in engine.stats["backend"]["declined"]
            assert "cpu:decoder-layers" not in routes
        return [o.outputs[0].token_ids for o in outs]

    assert generate("cpu") == generate("torch")


@needs_compiler
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_bfloat16_engine_runs_the_c_kernels_and_matches_the_reference_backend(tmp_path_factory, family,
                                                                              monkeypatch):
    # In bfloat16 the decode attention, norms, rotary and activations run in
    # C (counted), none declined: Gemma-3's q/k norms and windows, Gemma-2's
    # soft-capped attention; so does the tied LM head on steps of up to
    # head.MAX_ROWS rows, where the CPU has the bfloat16 dot product (its
    # logits among those compared). Greedy tokens equal the reference backend's up
    # to a near-tie: the two round differently (the kernel's attention keeps
    # float32 scores where the reference rounds them), so their logits
    # differ by a few bfloat16 steps, and where the reference's top two are
    # that close the tokens may part. (Not gpt-oss here: its router picks
    # experts, where a near-tie of two router logits moves the logits far.)
    from oracle import record_logits

    path = model_dir(tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 23, 2, 37, 5))]
    runs = {}
    for name in ("cpu", "torch"):
        engine = Engine(path, kv_cache_memory="96KiB", block_size=4, max_num_batched_tokens=16, progress=False,
                        backend=name, dtype="bfloat16")
        calls = {}
        if name == "cpu":
            assert not [d for d in engine.stats["backend"]["declined"] if d.startswith(("C decode attention", "C norms"))]
            lib = engine.backend.lib
            kernels = {"decode_attention", "norm_rotary", "gated_activation"} | \
                ({"head_products"} if lib.native_bf16_products else set())
            for kernel in kernels:
                def counted(*args, _fn=getattr(lib, kernel), _name=kernel):
                    calls[_name] = calls.get(_name, 0) + 1
                    return _fn(*args)
                monkeypatch.setattr(lib, kernel, counted)
        logits = record_logits(engine)
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert name == "torch" or set(calls) == kernels
        ids = sorted({s for s, _, _ in logits})  # the prompts' sequence ids, in order
        runs[name] = [o.outputs[0].token_ids for o in outs], {(ids.index(s), p): row for s, p, row in logits}
    (cpu, cpu_logits), (ref, ref_logits) = runs["cpu"], runs["torch"]
    same = 0
    for i, (got, expected) in enumerate(zip(cpu, ref)):
        parted = next((j for j in range(len(got)) if got[j] != expected[j]), len(got))
        same += parted
        for j in range(min(parted + 1, len(got))):
            key = (i, len(prompts[i]) - 1 + j)  # (prompt, position) of token j
            row = ref_logits[key]
            assert (cpu_logits[key] - row).abs().max() < 0.02
            assert row[got[j]] >= row.max() - 0.01  # a near-tie where they part
    assert same >= sum(map(len, ref)) // 2  # most tokens compared, not cut short by a parting


@needs_compiler
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("route", ["decoder-layers", "decoder-stages"])
def test_decoder_layers_in_one_call_match_the_modules(tmp_path_factory, family, dtype, route, monkeypatch):
    # Every step the backend routes to the one-call layers (up to `rows`
    # rows), or to their stages between the modules' products (more rows),
    # runs twice from the same pool: through the modules, then through the
    # C layers; hidden states and the pool must agree. The pool starts as NaN bytes, so a
    # slot the C layer should have zeroed (a fresh block's tail) or written
    # and did not shows up. Gemma-3: q/k norms, windows of 8 keys; Gemma-2:
    # soft-capped attention, no q/k norms; Mistral: no post norms, SiLU.
    # In bfloat16 the modules round after every op and the C layer only
    # where it stores (decoder.py): they agree to a few bfloat16 steps of
    # each tensor's largest values (a rotated K element is the difference of
    # two terms that size, each rounded by the modules).
    path = model_dir(tmp_path_factory, family)
    rows = decoder.max_rows(library.load(), dtype)  # 3, or 11 on the CPU's bfloat16 dot product
    seqs = min(rows, 7) if route == "decoder-layers" else rows + 3
    engine = Engine(path, kv_cache_memory="512KiB", block_size=4, max_num_seqs=seqs,
                    max_num_batched_tokens=16 if route == "decoder-layers" else 128, progress=False, backend="cpu",
                    dtype=str(dtype).removeprefix("torch."))

    def tolerance(expected):
        if dtype == torch.float32:
            return dict(atol=2e-5, rtol=1e-4)
        finite = expected.float().nan_to_num(0.0, 0.0, 0.0)
        return dict(atol=3e-2 * finite.abs().max().item(), rtol=0.0)  # ~4 steps at the largest
    model = engine.worker.model
    assert all(isinstance(layer, decoder.CpuDecoderLayer) for layer in model.model.layers)
    pool = engine.worker.buffers.pool
    pool.fill_(255)
    forward, rows_compared = model.forward, []

    def both(batch):
        if batch.route != route:
            return forward(batch)
        step, before = batch.route_state, pool.clone()
        batch.route_state = None  # the modules
        expected, pool_after = forward(batch), pool.clone()
        pool.copy_(before)
        batch.route_state = step
        got = forward(batch)
        rows_compared.append(len(batch.input_ids))
        torch.testing.assert_close(got, expected, **tolerance(expected))
        torch.testing.assert_close(pool.view(dtype), pool_after.view(dtype), **tolerance(pool_after.view(dtype)),
                                   equal_nan=True)
        return got

    monkeypatch.setattr(model, "forward", both)
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    lengths = (11, 4, 2, 7, 5, 9, 3)
    prompts = [[(7 * i + 5 * j) % 200 + 3 for j in range(lengths[i % 7])] for i in range(seqs)]
    engine.generate(prompts, params, use_tqdm=False)
    engine.generate(prompts[:1], params, use_tqdm=False)
    routes = engine.stats["backend"]["routes"]
    assert routes[f"cpu:{route}"] == len(rows_compared) and routes["cpu:modules"] > 0
    if route == "decoder-layers":
        # decode steps of one row and of several ran through the C layer, past
        # one tile of four rows where the route takes them
        assert 1 in rows_compared and max(rows_compared) == min(rows, 7)
    else:  # every decode step of more rows, all sequences at once among them
        assert min(rows_compared) > rows and max(rows_compared) == seqs


@needs_compiler
def test_decoder_layers_are_wrapped_only_with_room_for_their_dense_weights(tmp_path_factory, monkeypatch):
    # A wrapped layer keeps its dense weights beside oneDNN's packed ones;
    # with no room, the layers stay on the modules (the report says why),
    # and the tokens are the same.
    from hybridkv.layers.backends.cpu import linear

    path = model_dir(tmp_path_factory, "gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 11, 3, 7], [8, 2]]
    wrapped = Engine(path, kv_cache_memory="96KiB", block_size=4, progress=False, backend="cpu")
    monkeypatch.setattr(linear, "spare_memory", lambda: 0)
    unwrapped = Engine(path, kv_cache_memory="96KiB", block_size=4, progress=False, backend="cpu")
    assert all(isinstance(layer, decoder.CpuDecoderLayer) for layer in wrapped.worker.model.model.layers)
    assert not any(isinstance(layer, decoder.CpuDecoderLayer) for layer in unwrapped.worker.model.model.layers)
    assert any("one-call decoder layers" in d for d in unwrapped.stats["backend"]["declined"])
    # The Linear layers read packed copies either way.
    assert all(m.weight.numel() == 0 for m in unwrapped.worker.model.model.layers[0].mlp.modules()
               if getattr(m, "packed", None) is not None)
    assert [o.outputs[0].token_ids for o in wrapped.generate(prompts, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in unwrapped.generate(prompts, params, use_tqdm=False)]
    assert "cpu:decoder-layers" not in unwrapped.stats["backend"]["routes"]


# -- where it cannot run ------------------------------------------------------------
@pytest.fixture
def nothing_built(tmp_path, monkeypatch):
    """No build for this machine anywhere: an empty package folder and cache."""
    monkeypatch.setattr(build, "PACKAGE_DIR", tmp_path / "package")
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_not_built_auto_warns_and_runs_the_reference_and_cpu_says_how_to_build(nothing_built):
    with pytest.warns(RuntimeWarning, match="hybridkv build-kernels"):
        assert backends.choose("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="not built for this machine.*hybridkv build-kernels"):
        backends.choose("cpu", "cpu")


def test_without_a_compiler_the_message_says_so(nothing_built, monkeypatch):
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(nothing_built))  # no cc, gcc or clang
    assert build.compiler() is None
    with pytest.raises(RuntimeError, match="no C compiler here"):
        backends.choose("cpu", "cpu")
    with pytest.raises(RuntimeError, match="no C compiler found"):
        build.build()


@needs_compiler
def test_a_failing_build_raises_with_the_compilers_message_and_leaves_nothing(nothing_built, monkeypatch):
    monkeypatch.setattr(build, "FLAGS", [*build.FLAGS, "-fno-such-option"])
    with pytest.raises(RuntimeError, match="no-such-option"):
        build.build()
    assert not list((nothing_built / "package").iterdir())  # no half-built library left behind


@needs_compiler
@pytest.mark.parametrize("flag, turned_off", [("avx512f", "avx512f"), ("avx512_vnni", "avx512vnni")])
def test_the_kernels_built_without_avx512_pass_their_self_test(tmp_path, flag, turned_off):
    # The portable paths a CPU with AVX2 and no AVX-512 runs (bfloat16
    # widening, int8 and float8 codes, the products), and int8 pages'
    # integer products without VNNI (madd and add): the same source built
    # with that turned off, held to torch like the native build.
    from dataclasses import replace

    from hybridkv.core import native

    if flag not in native.cpu_flags().split():
        pytest.skip(f"this CPU has no {flag}: the native build already takes the paths without it")
    portable = replace(native.CPU_KERNELS, flags=native.CPU_KERNELS.flags + (f"-mno-{turned_off}",))
    check.check(library.Kernels(portable.build_into(tmp_path)))


@needs_compiler
def test_a_build_lands_under_one_name_per_source_and_machine(nothing_built):
    first = build.build()
    assert first.parent == nothing_built / "package" and first.name == build.library_name()
    assert build.built_library() == first
    assert build.build().name == first.name  # rebuilt in place, under the same name
    assert [p.name for p in first.parent.iterdir()] == [first.name]


@needs_compiler
def test_a_kernel_failing_its_self_test_makes_auto_warn(monkeypatch):
    monkeypatch.setattr(cpu, "_checked", {})
    monkeypatch.setattr(check, "check", lambda lib: (_ for _ in ()).throw(AssertionError("decode_layer differs")))
    with pytest.warns(RuntimeWarning, match="failed their self-test: decode_layer differs"):
        assert backends.choose("auto", "cpu").name == "torch"


def test_the_cli_builds_them(nothing_built, capsys):
    from hybridkv.cli import main

    from hybridkv.core.native import HASH_CHAIN

    if build.compiler() is None:
        assert main(["build-kernels", "--cache"]) == 1
        return
    assert main(["build-kernels", "--cache"]) == 0  # (into this test's cache folder)
    out = capsys.readouterr().out
    assert build.library_name() in out and HASH_CHAIN.library_name() in out
    assert build.built_library() == build.cache_dir() / build.library_name()
    assert (HASH_CHAIN.cache_dir() / HASH_CHAIN.library_name()).is_file()


# -- the fused elementwise modules ----------------------------------------------------
@needs_compiler
@pytest.mark.parametrize("rows", [3, 700])  # one thread, and enough work for both
@pytest.mark.parametrize("dim", [40, 256, 72])  # remainders past the vector width
def test_fused_norms_and_rotary_match_torch(lib, rows, dim):
    from hybridkv.layers.norm import RMSNorm
    from hybridkv.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(2)
    for unit_offset in (True, False):
        norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0.0 if unit_offset else 1.0))
        fused = twin(CpuRMSNorm, norm, lib=lib)
        packed = torch.randn(rows, 7 * dim, generator=gen) * 3
        heads = packed[:, dim:5 * dim].view(rows, 4, dim)  # strided, as q out of the fused q/k/v product
        cos, sin = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
        torch.testing.assert_close(fused(packed[:, :dim]), norm(packed[:, :dim]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused(heads), norm(heads), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused.rotated(heads, cos, sin), apply_rotary(norm(heads), cos, sin),
                                   atol=2e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,inter", [(2, 24), (300, 1000)])
def test_fused_gated_activation_matches_torch(lib, activation, rows, inter):
    from hybridkv.layers.backends.cpu.modules import swap_norms_and_mlps
    from hybridkv.layers.mlp import GatedMLP

    torch.manual_seed(3)
    holder = torch.nn.Module()
    holder.mlp = GatedMLP(16, inter, activation)
    holder.mlp.fuse()
    x = torch.randn(rows, 16) * 4  # gates far into both tails of the activation
    with torch.no_grad():
        expected = holder.mlp(x)
        assert swap_norms_and_mlps(holder, lib) == (0, 1)
        torch.testing.assert_close(holder.mlp(x), expected, atol=1e-5, rtol=1e-4)
    holder.mlp = GatedMLP(16, inter, "gelu")
    holder.mlp.fuse()
    assert swap_norms_and_mlps(holder, lib) == (0, 0)  # GELU's erf form stays torch's


@needs_compiler
@pytest.mark.parametrize("rows", [3, 700])  # one thread, and enough work for both
@pytest.mark.parametrize("dim", [40, 256, 72])  # remainders past the vector width
def test_fused_norms_and_rotary_in_bfloat16_round_where_torch_does(lib, rows, dim):
    # Gemma's (1 + w) and gpt-oss's float32 weight scale the norm in float32,
    # rounded once; Llama's w scales the norm rounded first; the rotation
    # rounds each product and the sum. So the C results are torch's but where
    # the float32 sums' order flips a rounding (check._bf16_equal: one element
    # in a thousand, by one step), and the rotation is torch's exactly.
    from hybridkv.layers.norm import RMSNorm
    from hybridkv.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(2)
    for unit_offset, scale_in_float32 in ((True, False), (False, False), (False, True)):
        norm = RMSNorm(dim, 1e-6, unit_offset=unit_offset, scale_in_float32=scale_in_float32)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0.0 if unit_offset else 1.0))
        norm.to(torch.float32 if scale_in_float32 else torch.bfloat16)  # gpt-oss keeps its norm weights float32
        fused = twin(CpuRMSNorm, norm, lib=lib)
        packed = (torch.randn(rows, 7 * dim, generator=gen) * 3).bfloat16()
        heads = packed[:, dim:5 * dim].view(rows, 4, dim)  # strided, as q out of the fused q/k/v product
        cos, sin = torch.randn(rows, dim, generator=gen).bfloat16(), torch.randn(rows, dim, generator=gen).bfloat16()
        assert fused._usable(heads)  # the C kernel, not torch's fallback
        what = f"unit_offset={unit_offset}, scale_in_float32={scale_in_float32}"
        check._bf16_equal(fused(packed[:, :dim]), norm(packed[:, :dim]), what)
        check._bf16_equal(fused(heads), norm(heads), what)
        assert torch.equal(fused.rotated(heads, cos, sin), apply_rotary(fused(heads), cos, sin))


@needs_compiler
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows,inter", [(2, 24), (300, 1000)])
def test_fused_gated_activation_in_bfloat16_rounds_where_torch_does(lib, activation, rows, inter):
    # act(gate) rounded, then times up rounded: torch's two ops. Torch's
    # float32 GELU-tanh computes 1 + tanh(y), which cancels for negative
    # gates (relative errors of 1e-4 from a gate of -3, exactly 0 below -6),
    # where the kernel's x * sigmoid(2y) keeps its precision: there the rule
    # in float64 is what rounds alike, and torch's module is a step away at
    # most, or its own error (under 4e-6).
    from hybridkv.layers.backends.cpu.modules import swap_norms_and_mlps
    from hybridkv.layers.mlp import GatedMLP

    torch.manual_seed(3)
    holder = torch.nn.Module()
    holder.mlp = GatedMLP(16, inter, activation).bfloat16()
    holder.mlp.fuse()
    x = (torch.randn(rows, 16) * 4).bfloat16()  # gates far into both tails of the activation
    with torch.no_grad():
        gate, up = holder.mlp.gate_up_proj(x).chunk(2, dim=-1)
        expected = holder.mlp.activated(x)
        assert swap_norms_and_mlps(holder, lib) == (0, 1)
        got = holder.mlp.activated(x)
    if activation == "silu":
        check._bf16_equal(got, expected, activation)
        return
    g = gate.double()
    rule = (g * torch.sigmoid(1.5957691216057308 * (g + 0.044715 * g ** 3))).bfloat16() * up
    check._bf16_equal(got, rule, activation, atol=1e-30)  # below 1e-30 the kernel's exp stops at e^-87
    assert ((got.float() - expected.float()).abs() <= check._steps(expected) + 4e-6).all()
