"""The FlashInfer backend's side of the bargain, on the CPU: the page
tables, windows and query ranges it hands FlashInfer (layers/backends/
flashinfer/attention.py), read under FlashInfer's documented semantics
(`emulate`), give the torch reference's attention for decodes and prefill
chunks, full and sliding-window, soft-capped or not, in any column of
multi-page blocks. Slots the arguments must not name hold NaN. The kernels
themselves need a GPU: `check` runs them against the same emulation there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.core import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from hybridkv.layers import backends
from hybridkv.layers.backends.flashinfer import attention as fi
from hybridkv.layers.backends.reference import attention as paged_attention
from hybridkv.layers.step import StepInputs, attention_step

# (tokens cached, tokens this step) per sequence: decodes and chunks mixed.
STEP = [(40, 1), (0, 19), (7, 1), (70, 1), (33, 12), (3, 1), (100, 30)]


def make_case(spec, bs=8, width=2, column=1, seed=0, q_heads=4, dim=16):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    kv_heads = spec.num_kv_heads
    blocks = [-(-(c + n) // bs) for c, n in STEP]
    pages = 1 + sum(blocks) * width
    cache = torch.full((pages, 2, bs, kv_heads, dim), float("nan"))
    free = rng.permutation(np.arange(1, pages))
    rows = rng.permutation(len(STEP) + 2)[:len(STEP)]
    table = np.zeros((width, len(STEP) + 2, max(blocks) + 1), dtype=np.int64)
    taken = 0
    for (cached, count), nb, row in zip(STEP, blocks, rows):
        own = free[taken:taken + nb * width].reshape(nb, width)
        taken += nb * width
        table[:, row, :nb] = own.T
        # What a query of this sequence may read, from the first visible
        # key's block start: the rest stays NaN.
        first = int(spec.first_visible(cached)) // bs * bs
        for pos in range(first, cached + count):
            cache[own[pos // bs, column], :, pos % bs] = torch.randn(2, kv_heads, dim, generator=gen)
    q = torch.randn(sum(n for _, n in STEP), q_heads, dim, generator=gen)
    inputs = StepInputs.from_host(np.zeros(len(q), dtype=np.int64), np.array([c for c, _ in STEP]),
                                  np.array([n for _, n in STEP]), rows, "cpu")
    step = attention_step(inputs, torch.from_numpy(table), spec, bs)
    return cache, q, step


@pytest.mark.parametrize("spec", [FullAttentionSpec(2, 16), SlidingWindowSpec(2, 16, sliding_window=5),
                                  SlidingWindowSpec(2, 16, sliding_window=24)], ids=["full", "window5", "window24"])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flashinfer_arguments_read_what_the_reference_reads(spec, softcap):
    cache, q, step = make_case(spec)
    column, scale = 1, 16 ** -0.5
    ref = paged_attention.attend(q, cache.nan_to_num(0.0), paged_attention.build(step), column, scale, softcap)
    meta = fi.build(step)
    window = fi.window_left(spec)
    decodes = meta.decode_tokens
    got = fi.emulate(q[decodes], cache[:, 0], cache[:, 1], torch.arange(len(decodes) + 1),
                     fi.decode_args(meta, column), window, scale, softcap)
    torch.testing.assert_close(got, ref[decodes], atol=2e-5, rtol=1e-5)
    got = fi.emulate(q[meta.chunk_tokens], cache[:, 0], cache[:, 1], meta.qo_indptr, fi.chunk_args(meta, column),
                     window, scale, softcap)
    torch.testing.assert_close(got, ref[meta.chunk_tokens], atol=2e-5, rtol=1e-5)
    assert sorted(torch.cat([decodes, meta.chunk_tokens]).tolist()) == list(range(len(q)))


def test_paged_args_start_at_the_block_of_the_first_visible_key():
    table = torch.arange(1, 31).view(3, 10)
    args = fi.paged_args(table, torch.tensor([2, 0]), torch.tensor([17, 0]), torch.tensor([40, 5]), 8)
    assert args.indptr.tolist() == [0, 4, 5]
    assert args.indices.tolist() == [23, 24, 25, 26, 1]  # row 2, blocks 2..5; row 0, block 0
    assert args.last_page_len.tolist() == [1, 6]


def test_only_full_and_window_layers_in_16_bit_caches_are_taken():
    assert fi.supports(SlidingWindowSpec(2, 16, sliding_window=8), torch.bfloat16)
    assert not fi.supports(FullAttentionSpec(2, 16), torch.float32)  # FlashInfer has no float32 kernels
    assert not fi.supports(ChunkedLocalSpec(2, 16, chunk_size=32), torch.bfloat16)
    with pytest.raises(ValueError, match="chunked_local"):
        fi.window_left(ChunkedLocalSpec(2, 16, chunk_size=32))


def test_asking_for_flashinfer_without_it_is_a_clear_error():
    backend = backends
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="pip install flashinfer-python"):
            backend.choose("flashinfer", "cpu")
    else:  # installed: still CUDA only
        with pytest.raises(RuntimeError, match="CUDA"):
            backend.choose("flashinfer", "cpu")


def test_the_backend_refuses_a_layout_it_cannot_run():
    from hybridkv.core import plan_layout
    from hybridkv.layers.backends.flashinfer import FlashInferBackend

    backend = FlashInferBackend.__new__(FlashInferBackend)  # no FlashInfer here: only what it declares
    cuda = torch.device("cuda")
    backend.check_layout(plan_layout({"a": SlidingWindowSpec(2, 16, "bfloat16", sliding_window=8)}, 1 << 20), cuda)
    with pytest.raises(ValueError, match="no float32 attention cache"):
        backend.check_layout(plan_layout({"a": FullAttentionSpec(2, 16, "float32")}, 1 << 20), cuda)
    with pytest.raises(ValueError, match="no chunked local attention"):
        backend.check_layout(plan_layout({"a": ChunkedLocalSpec(2, 16, "bfloat16", chunk_size=32)}, 1 << 20), cuda)
    with pytest.raises(ValueError, match="runs on cuda, not cpu"):
        backend.check_layout(plan_layout({"a": FullAttentionSpec(2, 16, "bfloat16")}, 1 << 20), "cpu")


def test_the_self_test_passes_on_the_documented_semantics_and_catches_a_wrong_window():
    import fake_flashinfer

    fake = fake_flashinfer.module()
    fi.check(fi.FlashInferAttention(fake, torch.device("cpu")), torch.device("cpu"))

    class NoWindowPrefill(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper):
        def plan(self, *args, window_left=-1, **kw):
            super().plan(*args, window_left=-1, **kw)  # a kernel that ignores the window

    fake.BatchPrefillWithPagedKVCacheWrapper = NoWindowPrefill
    with pytest.raises(RuntimeError, match="prefill \\(window_left 19\\)"):
        fi.check(fi.FlashInferAttention(fake, torch.device("cpu")), torch.device("cpu"))


@pytest.mark.parametrize("spec", [FullAttentionSpec(2, 16), SlidingWindowSpec(2, 16, sliding_window=5),
                                  ChunkedLocalSpec(2, 16, chunk_size=16)], ids=["full", "window5", "chunked"])
def test_prefill_through_flashinfer_beside_the_kernels_reads_what_the_reference_reads(spec):
    # "triton+flashinfer": a mixed step's chunks through FlashInfer (its
    # documented semantics), its decodes and stores through hybridkv's
    # kernels (triton's interpreter here); a chunked-local group all kernels.
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    import fake_flashinfer

    from hybridkv.layers.backends.triton import kernels

    cache, q, step = make_case(spec)
    cache, q = cache.to(torch.bfloat16), q.to(torch.bfloat16)
    column, scale = 1, 16 ** -0.5
    ref = paged_attention.attend(q.float(), cache.float().nan_to_num(0.0), paged_attention.build(step), column,
                                 scale, None)
    attention = fi.FlashInferPrefill(fake_flashinfer.module(), torch.device("cpu"), kernels())
    meta = attention.build(step)
    assert (meta.flashinfer is None) == (spec.kind == "chunked_local")
    out = attention.attend(q, cache, meta, column, scale)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    kinds = {kind for _, kind in attention.prefill._wrappers}
    assert kinds == (set() if spec.kind == "chunked_local" else {"prefill"})  # decodes never planned
    # Stores go through the kernel: new rows land at their slots.
    k, v = torch.randn(2, len(q), 2, 16).to(torch.bfloat16)
    attention.store(cache, k, v, meta, column)
    assert torch.equal(cache[step.store_pages[column], 0, step.store_offsets], k)


@pytest.mark.parametrize("family", ["gemma3", "jamba", "gpt_oss"])
def test_an_engine_on_triton_plus_flashinfer_generates_what_the_kernels_generate(tmp_path_factory, monkeypatch,
                                                                                 family):
    # The whole engine with FlashInfer (its documented semantics) taking the
    # prefill chunks: chunked prompts beside decodes, bf16 caches, the same
    # greedy tokens as hybridkv's kernels alone. gpt-oss's layers have
    # attention sinks, which FlashInfer does not take here: its chunks stay
    # on the kernels, and the prepare report says so.
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    import fake_flashinfer
    from oracle import model_dir

    from hybridkv import Engine, SamplingParams
    from hybridkv.engine import config as config_module, engine as engine_module
    from hybridkv.layers.backends.flashinfer import TritonFlashInferBackend
    from hybridkv.layers.backends.triton import kernels
    from hybridkv.layers.backends.triton.recurrent import recurrent_ops

    ops = kernels()
    # The backend as its constructor builds it, but on the CPU and the stand-in.
    combined = TritonFlashInferBackend.__new__(TritonFlashInferBackend)
    combined.capabilities = backends.Capabilities()
    combined.ops = ops
    backends.Backend.__init__(combined, fi.FlashInferPrefill(fake_flashinfer.module(), torch.device("cpu"), ops),
                              recurrent_ops(ops))
    chosen = engine_module.choose_backend
    monkeypatch.setattr(engine_module, "choose_backend",
                        lambda name, device: combined if name == "triton+flashinfer" else chosen(name, device))
    # (and past the check that refuses FlashInfer off CUDA before anything loads: EngineConfig.check_machine)
    monkeypatch.setattr(config_module, "check_backend", lambda name, device: None)
    path = model_dir(tmp_path_factory, family)
    prompts = [[(5 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 5, 1))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(name):
        engine = Engine(path, kv_cache_memory="256KiB", block_size=4, max_num_batched_tokens=8, dtype="bfloat16",
                        progress=False, backend=name)
        assert engine.backend.name == name
        declined = " ".join(engine.stats["backend"]["declined"])
        assert ("4 layers with attention sinks" in declined) == (name == "triton+flashinfer" and family == "gpt_oss")
        outs = engine.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert generate("triton+flashinfer") == generate("triton")
    planned = {kind for _, kind in combined.attention.prefill._wrappers}
    assert planned == (set() if family == "gpt_oss" else {"prefill"})
