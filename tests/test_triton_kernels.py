"""hybridkv's Triton kernels (layers/backends/triton/ops.py) against the torch
reference: K/V store, paged attention (decode, prefill, mixed steps) for
every attention type, the Mamba decode step, and the engine with the
kernels switched on.

Without a GPU (CI) they run on CPU under triton's interpreter with tiny
shapes (it runs every program in Python); they skip only when triton is
not installed. With CUDA they run compiled on the GPU, together with the
real-size tests at the end (Gemma-3-27B's attention at 8K and 32K, batch
64; a Jamba-1.5-Mini Mamba layer).

The interpreter must be switched on before the kernels are decorated, so
TRITON_INTERPRET is set here, before the kernels are imported (nothing
imports them before a triton backend is built).

Cache slots no query may read hold NaN, and so does the null page: a kernel
that loads one of them (a key outside the window, a released block,
padding) gets NaN in its output.
"""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")

from hybridkv import Engine, SamplingParams  # noqa: E402
from hybridkv.core import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec, plan_layout  # noqa: E402
from hybridkv.core.hf_config import load_config, specs_from_config  # noqa: E402
from hybridkv.layers import backends as backend  # noqa: E402
from hybridkv.layers.backends.reference import attention as paged_attention  # noqa: E402
from hybridkv.layers.backends.triton import attention as kernel_attention  # noqa: E402
from hybridkv.layers.backends.triton import ops  # noqa: E402
from hybridkv.layers.mamba_ops import causal_conv_step, selective_scan_step  # noqa: E402
from hybridkv.layers.step import StepInputs, attention_step  # noqa: E402
from oracle import model_dir  # noqa: E402

MODELS = os.path.join(os.path.dirname(__file__), "..", "models")
KINDS = {"full": "full", "sliding": "sliding_window", "chunked": "chunked_local"}


def make_spec(kind, size, kv_heads=2, dim=16):
    if kind == "sliding_window":
        return SlidingWindowSpec(kv_heads, dim, sliding_window=size)
    if kind == "chunked_local":
        return ChunkedLocalSpec(kv_heads, dim, chunk_size=size)
    return FullAttentionSpec(kv_heads, dim)
# (atol, rtol): float32 differs from the reference only by summation order.
TOL = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="real sizes: CUDA only (the interpreter would take hours)")


def test_kernels_run_compiled_on_cuda_or_under_the_interpreter():
    assert ops.INTERPRETED == (DEVICE == "cpu"), (
        "hybridkv.layers.backends.triton.ops was imported before this module chose TRITON_INTERPRET")


def layer_cache(pages, bs, kv_heads, dim, dtype, layers_per_page=2):
    """The last of `layers_per_page` layers sharing each page (plus 16
    spare bytes), viewed as KVBuffers views it: strided, never contiguous."""
    item = torch.empty(0, dtype=dtype).element_size()
    layer_bytes = 2 * bs * kv_heads * dim * item
    pool = torch.zeros(pages, layers_per_page * layer_bytes + 16, dtype=torch.uint8, device=DEVICE)
    start = (layers_per_page - 1) * layer_bytes
    return pool[:, start:start + layer_bytes].view(dtype).view(pages, 2, bs, kv_heads, dim)


def ints(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


# -- store -----------------------------------------------------------------------
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_rows_at_their_slots_and_skips_padding(bs, dtype):
    torch.manual_seed(bs)
    kv_heads, dim, tokens = 3, 24, 9
    cache = layer_cache(6, bs, kv_heads, dim, dtype)
    k = torch.randn(tokens, 2 * kv_heads, dim).to(DEVICE, dtype)[:, ::2]  # strided input rows
    v = torch.randn(tokens, kv_heads, dim).to(DEVICE, dtype)
    slots = ints([1 * bs + 0, -1, 2 * bs + bs - 1, 5 * bs + 3, -1, 3 * bs + 7, 4 * bs, 1 * bs + 1, -1])
    expected = cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // bs, 0, slot % bs] = k[t]
            expected[slot // bs, 1, slot % bs] = v[t]
    ops.store_kv(cache, k, v, slots)
    assert torch.equal(cache, expected)  # the null page and padding rows' slots untouched too


def test_store_converts_float32_rows_to_a_bfloat16_cache():
    # The interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to
    # nearest even): equal to the reference within one bfloat16 step.
    cache = layer_cache(4, 16, 2, 16, torch.bfloat16)
    k, v = torch.randn(5, 2, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
    slots = ints([17, 18, -1, 35, 63])
    ops.store_kv(cache, k, v, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for i, rows in enumerate((k, v)):
                torch.testing.assert_close(cache[slot // 16, i, slot % 16].float(), rows[t], atol=0, rtol=2 ** -7)


# -- paged attention -----------------------------------------------------------
# A mixed step: prefill chunks (one fresh, one continuing after cached tokens
# across block and chunk boundaries) and decodes (long past the window, at
# the first slot of a block, the very first token).
STEP = [(0, 9), (37, 21), (70, 1), (32, 1), (0, 1)]


class AttentionCase:
    """Requests with `cached` tokens and `count` new ones in one step, their
    blocks on random pages (`width` pages per block, this layer in column
    `column`), blocks the layer has released replaced by the null page, in
    a persistent table (`[width, table rows, max_blocks]`, from key position 0)
    at shuffled table rows.

    poison=True (small cases): every slot holds NaN except the keys some
    query of the step may read. poison=False (real sizes): random values
    everywhere, NaN in the null page only."""

    def __init__(self, kind, size, bs, group, dtype, dim=16, q_heads=4, width=1, column=0, seed=0,
                 step=STEP, layers_per_page=2, poison=True):
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        kv_heads = q_heads // group
        self.spec = make_spec(kind, size, kv_heads, dim)
        self.bs, self.step, self.width, self.column, self.dtype, self.poison = bs, step, width, column, dtype, poison
        blocks = [-(-(cached + count) // bs) for cached, count in step]
        self.cache = layer_cache(1 + sum(blocks) * width + 3, bs, kv_heads, dim, dtype, layers_per_page)
        if poison:
            self.cache.fill_(float("nan"))
        else:
            self.cache.normal_(generator=torch.Generator(DEVICE).manual_seed(seed))
            self.cache[0] = float("nan")
        free = rng.permutation(np.arange(1, self.cache.shape[0]))
        self.table_rows = rng.permutation(len(step) + 2)[:len(step)]  # rows of a table with spare rows
        table = np.zeros((width, len(step) + 2, max(blocks) + 2), dtype=np.int64)
        taken = 0
        for (cached, count), nb, row in zip(step, blocks, self.table_rows):
            pages = free[taken:taken + nb * width].reshape(nb, width).copy()
            taken += nb * width
            live = self.spec.first_visible(cached)
            pages[(np.arange(nb) + 1) * bs <= live] = 0  # released blocks
            table[:, row, :nb] = pages.T
            if poison:
                for pos in range(live, cached + count):
                    page = int(pages[pos // bs, column])
                    self.cache[page, :, pos % bs] = torch.randn(2, kv_heads, dim, generator=gen).to(DEVICE, dtype)
        self.table = torch.from_numpy(table).to(DEVICE)
        tokens = sum(count for _, count in step)
        self.q = torch.randn(tokens, q_heads, dim, generator=gen).to(DEVICE, dtype)
        counts = np.array([c for _, c in step])
        self.inputs = StepInputs.from_host(np.zeros(tokens, dtype=np.int64), np.array([c for c, _ in step]), counts,
                                           self.table_rows, DEVICE)
        step = attention_step(self.inputs, self.table, self.spec, bs)
        self.meta = paged_attention.build(step)
        self.kernel_meta = kernel_attention.build(step)

    def fixed(self):
        """The same step as a fixed-shape decode step (every sequence one
        token; no host layout): (inputs, reference meta, kernel meta)."""
        assert all(count == 1 for _, count in self.step)
        inputs = StepInputs.fixed(self.inputs.input_ids, self.inputs.positions, self.inputs.table_rows,
                                  torch.arange(len(self.step), device=DEVICE))
        step = attention_step(inputs, self.table, self.spec, self.bs)
        return inputs, paged_attention.build(step), kernel_attention.build(step)

    def reference(self, scale, softcap, meta=None, sinks=None):
        """The torch reference on a NaN-free copy (it reads masked slots of
        blocks it gathers; the engine's store keeps those finite, this test
        poisons them)."""
        meta = meta or self.meta
        if self.poison:  # a clean copy (small)
            return paged_attention.attend(self.q, self.cache.nan_to_num(0.0), meta, self.column, scale,
                                          softcap, sinks).float()
        self.cache[0] = 0.0
        try:
            return paged_attention.attend(self.q, self.cache, meta, self.column, scale, softcap, sinks).float()
        finally:
            self.cache[0] = float("nan")


CASES = [("full", 0), ("sliding", 5), ("sliding", 23), ("sliding", 40), ("chunked", 24), ("chunked", 48)]


def check_attention(case, scale, softcap, splits=1, direct=True, sinks=None):
    ref = case.reference(scale, softcap, sinks=sinks)
    atol, rtol = TOL[case.dtype]
    # 1. Through the kernel backend's metadata and ops.
    out = kernel_attention.TritonAttention(ops).attend(case.q, case.cache, case.kernel_meta, case.column, scale,
                                                       softcap, sinks)
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    if not direct:
        return
    # 2. The kernels called directly, with key splits and small tiles.
    out = torch.full_like(case.q, float("nan"))
    decode = [i for i, (_, count) in enumerate(case.step) if count == 1]
    prefill = [i for i, (_, count) in enumerate(case.step) if count > 1]
    rows = np.concatenate(([0], np.cumsum([c for _, c in case.step])[:-1]))
    table = case.table[case.column]
    positions = case.inputs.positions
    first = case.spec.first_visible(positions)
    table_rows = case.table_rows
    if decode:
        r = ints(rows[decode])
        ops.paged_decode_attention(out, case.q, case.cache, r, table, ints(table_rows[decode]), positions[r],
                                   first[r], scale=scale, softcap=softcap, sinks=sinks, splits=splits, block_n=16)
    if prefill:
        ops.paged_prefill_attention(out, case.q, case.cache, ints(rows[prefill]),
                                    ints([case.step[i][1] for i in prefill]), table, ints(table_rows[prefill]),
                                    positions, first, max_length=max(case.step[i][1] for i in prefill), scale=scale,
                                    softcap=softcap, sinks=sinks, block_m=16, block_n=32)
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("kind,size", CASES)
def test_paged_attention_matches_the_reference_float32(kind, size, bs, group):
    # Windows smaller than a block, larger and not a multiple of it; chunks
    # of one and several blocks; GQA ratios 1/2/4; key splits in the direct run.
    case = AttentionCase(KINDS[kind], size, bs, group, torch.float32, seed=bs + group)
    check_attention(case, scale=0.3, softcap=None, splits=1 + group // 2)


@pytest.mark.parametrize("kind,size", CASES)
def test_paged_attention_matches_the_reference_bfloat16(kind, size):
    case = AttentionCase(KINDS[kind], size, 16, 2, torch.bfloat16, seed=7)
    check_attention(case, scale=0.3, softcap=None, splits=2)


def test_16_bit_dots_are_refused_where_they_would_be_wrong():
    # The prefill kernel's dot_16bit variant (benchmarks/kernels.py sweeps it
    # on a GPU) takes 16-bit caches only, and never runs under the
    # interpreter, whose 16-bit dots are wrong.
    case = AttentionCase(KINDS["full"], 0, 16, 2, torch.float32, seed=1)
    chunks = case.kernel_meta.step.inputs.chunks
    out = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="16-bit cache"):
        ops.paged_prefill_attention(out, case.q, case.cache, chunks.starts, chunks.lengths, case.table[case.column],
                                    chunks.table_rows, case.inputs.positions, case.spec.first_visible(
                                        case.inputs.positions), max_length=chunks.longest, scale=0.3,
                                    dot_16bit=True)


@gpu_only
@pytest.mark.parametrize("kind,size", CASES)
def test_16_bit_dots_match_the_reference_on_a_gpu(kind, size):
    case = AttentionCase(KINDS[kind], size, 16, 2, torch.bfloat16, seed=11)
    ref = case.reference(0.3, None)
    chunks = case.kernel_meta.step.inputs.chunks
    rows = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(chunks.starts.cpu(), chunks.lengths.cpu())])
    for block_m, block_n, stages in ((32, 64, None), (64, 64, 2), (128, 32, 3)):
        out = torch.full_like(case.q, float("nan"))
        ops.paged_prefill_attention(out, case.q, case.cache, chunks.starts, chunks.lengths, case.table[case.column],
                                    chunks.table_rows, case.inputs.positions,
                                    case.spec.first_visible(case.inputs.positions), max_length=chunks.longest,
                                    scale=0.3, block_m=block_m, block_n=block_n, num_stages=stages, dot_16bit=True)
        torch.testing.assert_close(out[rows].float(), ref[rows], atol=2e-2, rtol=2e-2)


def test_decode_splits_are_few_powers_of_two_and_tiles_follow_the_sweep(monkeypatch):
    # Each splits value is a kernel variant compiled on first use (seconds
    # with wide heads, measured on an H100): a mixed step's decode count is
    # arbitrary, so the values it can take must be few.
    monkeypatch.setitem(kernel_attention._sm_count, 0, 132)
    cuda = torch.device("cuda", 0)
    seen = {kernel_attention.decode_splits(cuda, programs, max_keys)
            for programs in range(1, 300) for max_keys in (256, 2048, 32768)}
    assert seen == {1, 2, 4, 8, 16}
    assert kernel_attention.decode_splits(cuda, 1, 2048) == 4  # never slices under 512 keys
    assert kernel_attention.decode_splits(cuda, 200, 32768) == 1  # enough programs already
    assert kernel_attention.decode_splits(torch.device("cpu"), 1, 32768) == 1
    assert kernel_attention.decode_block_n("full", 128, 2) == 128
    assert kernel_attention.decode_block_n("sliding_window", 128, 2) == 32
    assert kernel_attention.decode_block_n("full", 256, 2) == 64  # Gemma-3-1B / 270M heads: unmeasured
    assert kernel_attention.decode_block_n("full", 128, 4) == 64  # float32 tiles spill


@pytest.mark.parametrize("kind,size", [("sliding", 23), ("full", 0)])
def test_soft_capped_attention_matches_the_reference(kind, size):
    # Gemma-2's logit soft-cap (and Gemma-3's query_pre_attn_scalar scale);
    # large scores so that the cap really bends them.
    case = AttentionCase(KINDS[kind], size, 16, 2, torch.float32, seed=3)
    check_attention(case, scale=2.0, softcap=5.0, splits=2)


@pytest.mark.parametrize("kind,size", [("sliding", 5), ("sliding", 23), ("full", 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_match_the_reference(kind, size, dtype):
    # gpt-oss: a logit per query head in each softmax's denominator; they
    # start the online softmax, in the first of several key splits only.
    case = AttentionCase(KINDS[kind], size, 16, 2, dtype, seed=11)
    sinks = torch.randn(case.q.shape[1], generator=torch.Generator().manual_seed(3)).to(DEVICE) * 3
    assert (case.reference(0.3, None, sinks=sinks) - case.reference(0.3, None)).abs().max() > 0.1
    check_attention(case, scale=0.3, softcap=None, splits=3, sinks=sinks)
    check_attention(case, scale=0.3, softcap=5.0, splits=1, sinks=sinks.to(torch.bfloat16))


def test_a_layer_in_a_later_column_of_multi_page_blocks():
    # A group whose block spans 3 pages; the layer reads column 2.
    case = AttentionCase("sliding_window", 23, 16, 2, torch.float32, width=3, column=2, seed=11)
    check_attention(case, scale=0.25, softcap=None)


def test_head_dim_not_a_power_of_two():
    case = AttentionCase("full", 0, 16, 4, torch.float32, dim=24, seed=5, step=[(0, 5), (20, 1), (41, 1)])
    check_attention(case, scale=24 ** -0.5, softcap=None)


@pytest.mark.parametrize("kind,size", [("full", 0), ("sliding", 5), ("sliding", 40), ("sliding", 130), ("chunked", 24),
                                       ("chunked", 70)])
def test_long_prefill_in_query_tiles_matches_one_masked_call(kind, size, monkeypatch):
    # The reference cuts a long prefill segment into query tiles with
    # only the key columns they can see; the result must be what one masked
    # call over all keys gives (fresh prompt, and one continuing mid-block).
    case = AttentionCase(KINDS[kind], size, 16, 2, torch.float32, seed=size, step=[(0, 600), (45, 530), (7, 1)])
    tiled = case.reference(0.3, None)
    assert any(len(paged_attention.query_tiles(case.spec, seg)) > 2 for seg in case.meta.prefills)
    monkeypatch.setattr(paged_attention, "query_tiles", lambda spec, seg: [(0, seg.length, 0, seg.mask.shape[-1])])
    torch.testing.assert_close(tiled, case.reference(0.3, None), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind,size", [("full", 0), ("sliding", 5), ("sliding", 23), ("chunked", 24)])
def test_fixed_shape_decode_metadata_reads_what_the_exact_one_reads(kind, size):
    # A decode-only step at fixed shapes (no host layout: what a CUDA graph
    # captures) gives what the eager metadata gives, on both backends.
    step = [(70, 1), (32, 1), (0, 1), (5, 1), (44, 1)]
    case = AttentionCase(KINDS[kind], size, 16, 2, torch.float32, seed=13, step=step)
    exact = case.reference(0.3, None)
    _, ref_meta, kernel_meta = case.fixed()
    assert len(ref_meta.decodes) == 1 and ref_meta.decodes[0].pages.shape[-1] == \
        paged_attention.read_bound(case.spec, 16, case.table.shape[2])
    torch.testing.assert_close(case.reference(0.3, None, meta=ref_meta), exact, atol=2e-6, rtol=1e-5)
    out = kernel_attention.TritonAttention(ops).attend(case.q, case.cache, kernel_meta, case.column, 0.3, None)
    torch.testing.assert_close(out.float(), exact, atol=2e-5, rtol=1e-5)


def test_store_matches_the_reference_and_zeroes_the_rest_of_the_last_block():
    case = AttentionCase("full", 0, 16, 2, torch.float32, width=2, column=1, seed=2)
    cache = case.cache.nan_to_num(0.0)
    tokens, heads, dim = case.q.shape[0], cache.shape[3], cache.shape[4]
    k, v = torch.randn(tokens, heads, dim, device=DEVICE), torch.randn(tokens, heads, dim, device=DEVICE)
    cache[:] = float("nan")  # what another layer type may have left in the pages
    expected = cache.clone()
    paged_attention.store(expected, k, v, case.meta, case.column)
    kernel_attention.TritonAttention(ops).store(cache, k, v, case.kernel_meta, case.column)
    written = ~torch.isnan(cache)
    assert torch.equal(cache[written], expected[written])  # the kernel writes the same slots
    # The reference also zeroes the rest of a sequence's last block after its
    # new tokens when this step writes that block first (later steps find it zeroed).
    fresh = 0
    for (cached, count), row in zip(case.step, case.table_rows):
        last = cached + count - 1
        page = int(case.table[case.column, row, last // 16])
        rest = expected[page, :, last % 16 + 1:]
        if last // 16 * 16 >= cached:
            fresh += 1
            assert torch.equal(rest, torch.zeros_like(rest))
        else:
            assert torch.isnan(rest).all()  # written before: left as it is
    assert 0 < fresh < len(case.step)


# -- Mamba decode step ---------------------------------------------------------
class MambaCase:
    """Four requests' states of a Mamba group (`width` pages per state
    block, this layer's conv and SSM parts at byte offsets that straddle
    pages). Rows: 0 updates in place, 1 reads one block and writes another
    (a checkpoint), 2 has no state yet (its read pages are the null page),
    3 in place again."""

    def __init__(self, conv_dtype, x_dtype, seed=0, channels=20, conv_width=4, state=8, page=64, width=16,
                 conv_offset=64, ssm_offset=None):
        gen = torch.Generator().manual_seed(seed)
        I, K, N = channels, conv_width, state
        self.channels, self.conv_width, self.state, self.page, self.width = I, K, N, page, width
        conv_bytes = I * (K - 1) * torch.empty(0, dtype=conv_dtype).element_size()
        self.conv_offset = conv_offset
        self.ssm_offset = ssm_offset or conv_offset + -(-conv_bytes // 16) * 16
        assert self.ssm_offset + I * N * 4 <= page * width
        self.conv_dtype = conv_dtype
        pages = 1 + 5 * width
        self.pool = torch.randint(0, 256, (pages, page), dtype=torch.uint8, generator=gen).to(DEVICE)
        ids = (torch.randperm(pages - 1, generator=gen)[:5 * width].view(5, width) + 1).to(DEVICE)
        self.read = torch.stack([ids[0], ids[1], torch.zeros_like(ids[0]), ids[3]])
        self.write = torch.stack([ids[0], ids[2], ids[4], ids[3]])
        self.zero = torch.tensor([False, False, True, False], device=DEVICE)
        # Finite states where they are read (the random bytes elsewhere stay).
        flat = self.pool[self.read].reshape(4, -1)
        conv, ssm = self.views(flat)
        conv.copy_(torch.randn(conv.shape, generator=gen).to(conv_dtype))
        ssm.copy_(torch.randn(ssm.shape, generator=gen))
        for r in (0, 1, 3):
            self.pool[self.read[r]] = flat[r].view(width, page)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(DEVICE)

        self.x = randn(4, I).to(x_dtype)
        self.weight, self.bias = randn(I, K).to(x_dtype), randn(I).to(x_dtype)
        self.dt, self.A = F.softplus(randn(4, I)), -torch.exp(randn(I, N))
        self.B, self.C, self.D, self.gate = randn(4, N), randn(4, N), randn(I), randn(4, I)

    def views(self, flat):
        I, K, N = self.channels, self.conv_width, self.state
        conv_bytes = I * (K - 1) * torch.empty(0, dtype=self.conv_dtype).element_size()
        conv = flat[:, self.conv_offset:self.conv_offset + conv_bytes].view(self.conv_dtype).view(-1, I, K - 1)
        ssm = flat[:, self.ssm_offset:self.ssm_offset + I * N * 4].view(torch.float32).view(-1, I, N)
        return conv, ssm

    def states(self, pages, zero):
        """Conv and SSM states of each row as the torch path gathers them."""
        flat = self.pool[pages].reshape(pages.shape[0], -1).clone()
        flat[zero] = 0
        return self.views(flat)


def check_mamba_step(case, x_dtype):
    conv0, ssm0 = case.states(case.read, case.zero)
    ref_x, ref_conv = causal_conv_step(case.x, conv0, case.weight, case.bias)
    ref_x = F.silu(ref_x)
    ref_y, ref_ssm = selective_scan_step(ref_x, case.dt, case.A, case.B, case.C, ssm0)
    ref_y = (ref_y + ref_x.float() * case.D) * F.silu(case.gate)
    written = set(case.write.reshape(-1).tolist())
    untouched = [p for p in range(case.pool.shape[0]) if p not in written]
    before = case.pool.clone()

    x = ops.mamba_conv_step(case.pool, case.read, case.write, case.zero, case.conv_offset, case.conv_dtype, case.x,
                            case.weight, case.bias, silu=True)
    y = ops.mamba_ssm_step(case.pool, case.read, case.write, case.zero, case.ssm_offset, torch.float32, x,
                           case.dt, case.A, case.B, case.C, case.D, case.gate)

    atol, rtol = TOL[x_dtype]
    torch.testing.assert_close(x.float(), ref_x.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(y, ref_y, atol=atol * 5, rtol=rtol)
    conv1, ssm1 = case.states(case.write, torch.zeros_like(case.zero))
    torch.testing.assert_close(conv1.float(), ref_conv.to(case.conv_dtype).float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(ssm1, ref_ssm, atol=atol * 5, rtol=rtol)
    assert torch.equal(case.pool[untouched], before[untouched]), "a page outside the write blocks changed"
    # Only this layer's parts of the write blocks changed (other layers' bytes stay).
    flat_before = before[case.write].reshape(4, -1)
    flat_after = case.pool[case.write].reshape(4, -1)
    parts = torch.zeros(flat_after.shape[1], dtype=torch.bool, device=DEVICE)
    parts[case.conv_offset:case.conv_offset + conv1[0].numel() * conv1.element_size()] = True
    parts[case.ssm_offset:case.ssm_offset + ssm1[0].numel() * 4] = True
    assert torch.equal(flat_after[:, ~parts], flat_before[:, ~parts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mamba_decode_step_updates_states_in_place_like_the_reference(dtype):
    check_mamba_step(MambaCase(dtype, dtype), dtype)


def test_mamba_step_without_bias_D_or_gate():
    case = MambaCase(torch.float32, torch.float32, seed=4)
    conv0, ssm0 = case.states(case.read, case.zero)
    ref_x, _ = causal_conv_step(case.x, conv0, case.weight, None)
    ref_y, _ = selective_scan_step(ref_x, case.dt, case.A, case.B, case.C, ssm0)
    x = ops.mamba_conv_step(case.pool, case.read, case.write, case.zero, case.conv_offset, torch.float32, case.x,
                            case.weight, None, silu=False)
    y = ops.mamba_ssm_step(case.pool, case.read, case.write, case.zero, case.ssm_offset, torch.float32, x,
                           case.dt, case.A, case.B, case.C)
    torch.testing.assert_close(x, ref_x, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-5)


# -- the norms', rotation's and gated MLPs' elementwise work, Mamba-1's prefill scan ---
from hybridkv.layers.mamba_ops import selective_scan  # noqa: E402
from hybridkv.layers.mlp import GatedMLP  # noqa: E402
from hybridkv.layers.norm import RMSNorm  # noqa: E402


def norm_module(convention, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, eps=1e-6, unit_offset=convention == "gemma", scale_in_float32=convention == "float32-scale")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + (0.0 if convention == "gemma" else 1.0))
    return norm


@pytest.mark.parametrize("convention", ["gemma", "llama", "float32-scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_kernel_matches_the_torch_norm_and_its_rotation(convention, dtype):
    from hybridkv.layers.backends.triton.modules import TritonRMSNorm
    from hybridkv.layers.backends.swap import twin
    from hybridkv.layers.rotary import Rotary

    gen = torch.Generator().manual_seed(1)
    tokens, heads, dim = 5, 3, 16
    norm = norm_module(convention, dim).to(DEVICE, dtype if convention != "float32-scale" else torch.float32)
    fused = twin(TritonRMSNorm, norm, ops=ops)
    # q as the projections leave it: a strided view of a wider row
    wide = (torch.randn(tokens, heads * dim + 8, generator=gen) * 3).to(DEVICE, dtype)
    q = wide[:, :heads * dim].view(tokens, heads, dim)
    cos, sin = Rotary(torch.rand(dim // 2, generator=gen)).cos_sin(torch.tensor([0, 3, 7, 100, 2047]).to(DEVICE),
                                                                  dtype)
    atol, rtol = TOL[dtype]
    hidden = (torch.randn(tokens, dim, generator=gen) * 3).to(DEVICE, dtype)
    torch.testing.assert_close(fused(hidden), norm(hidden), atol=atol, rtol=rtol)
    torch.testing.assert_close(fused(q), norm(q), atol=atol, rtol=rtol)
    torch.testing.assert_close(fused.rotated(q, cos, sin), norm.rotated(q, cos, sin), atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activation_kernel_matches_torch(kind, dtype):
    gen = torch.Generator().manual_seed(2)
    mlp = GatedMLP(8, 40, "gelu_pytorch_tanh" if kind == "gelu_tanh" else "silu")
    gate_up = (torch.randn(6, 80, generator=gen) * 3).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(ops.gated_activation(gate_up, kind), mlp.act(gate) * up, atol=atol, rtol=rtol)


def test_selective_scan_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    lengths, channels, n = [7, 4, 1], 40, 16  # channels: not a multiple of the tile
    R, L = len(lengths), max(lengths)
    x = torch.randn(R, L, channels, generator=gen)
    dt = F.softplus(torch.randn(R, L, channels, generator=gen))
    A = -torch.rand(channels, n, generator=gen) * 2
    B, C = torch.randn(R, L, n, generator=gen), torch.randn(R, L, n, generator=gen)
    state = torch.randn(R, channels, n, generator=gen)
    device_lengths = torch.tensor(lengths)
    ref_y, ref_h, _ = selective_scan(x, dt, A, B, C, state, device_lengths)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    y, h = ops.selective_scan(to(x), to(dt), to(A), to(B), to(C), to(state), to(device_lengths))
    for r, length in enumerate(lengths):
        torch.testing.assert_close(y[r, :length].cpu(), ref_y[r, :length], atol=1e-4, rtol=1e-4)
        assert not y[r, length:].any(), "outputs past a chunk's length"
    torch.testing.assert_close(h.cpu(), ref_h, atol=1e-4, rtol=1e-4)


# -- the engine with the kernels -------------------------------------------------
@pytest.mark.parametrize("family", ["gemma3", "jamba"])
def test_engine_with_triton_kernels_generates_the_reference_tokens(tmp_path_factory, family):
    # Block size 4 and 8 tokens a step: a prompt prefilled in two chunks, a
    # mixed step (a chunk beside a whole prompt), a one-token prompt (a
    # decode from the zero Mamba state), decodes past Gemma-3's window of 8
    # and across Jamba's block boundaries (rolling checkpoints: states read
    # from one block and written to another), all through the kernels: the
    # same greedy tokens as the torch reference.
    path = model_dir(tmp_path_factory, family)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 5, 1))]

    def generate(name, fixed=False):
        engine = Engine(path, kv_cache_memory="256KiB", block_size=4, max_num_batched_tokens=8, device=DEVICE,
                        progress=False, backend=name, fixed_shape_decode=fixed)
        assert engine.backend.name == name
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.kv.num_free_pages == engine.kv.num_total_pages
        return [o.outputs[0].token_ids for o in outs]

    reference = generate("torch")
    assert generate("triton") == reference
    assert generate("triton", fixed=True) == reference


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_the_kernels_on_quantized_pages_give_the_references_tokens(tmp_path_factory, kv_cache_dtype):
    # int8 pages (rows rotated) and float8 ones through the kernels'
    # quantizing store and their decode and prefill attention over codes:
    # a prompt prefilled in two chunks, decodes past Gemma-3's window of 8,
    # in eager and fixed-shape steps: the torch reference's greedy tokens on
    # the same pages.
    path = model_dir(tmp_path_factory, "gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((11, 5))]

    def generate(name, fixed=False):
        # (a short context: int8's key-centre calibration prompt, under the interpreter, is one of it)
        engine = Engine(path, kv_cache_memory="256KiB", block_size=4, max_num_batched_tokens=8, device=DEVICE,
                        progress=False, backend=name, fixed_shape_decode=fixed, kv_cache_dtype=kv_cache_dtype,
                        max_model_len=64)
        assert engine.backend.name == name and {g.spec.dtype for g in engine.layout.groups} <= {
            "int8", "float8_e4m3fn"}
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    reference = generate("torch")
    assert generate("triton") == reference
    assert generate("triton", fixed=True) == reference


def test_backend_is_chosen_once_auto_is_the_c_kernel_on_cpu_and_triton_there_needs_the_interpreter(monkeypatch):
    assert backend.choose("auto", "cpu").name == "cpu"  # tests/test_cpu_native.py: where it cannot be built
    assert backend.choose("torch", DEVICE).name == "torch"
    assert backend.choose("triton", DEVICE).name == "triton"
    if DEVICE == "cuda":
        assert backend.choose("auto", "cuda").name == "triton"
    monkeypatch.setenv("HYBRIDKV_BACKEND", "torch")
    assert backend.choose(None, DEVICE).name == "torch"
    monkeypatch.setattr(ops, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        backend.choose("triton", "cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        backend.choose("cuda", DEVICE)


# -- compiled for an H100, without one -------------------------------------------
# Under the interpreter nothing is compiled. This compiles every kernel for
# sm_90a (triton's own compiler and the ptxas it ships, no GPU needed) with
# the specialisation a launch on Gemma-3-27B / Jamba shapes gets (an int of
# 1 becomes a constant, multiples of 16 and pointers are marked divisible by
# 16), in a fresh process: the kernels must be imported without the interpreter.
AOT = r"""
import os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridkv.layers.backends.triton import ops

def compile(fn, args, consts, **options):
    signature, attrs, consts = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        value = args.get(name)
        if name in consts:
            signature[name] = "constexpr"
        elif isinstance(value, str):
            signature[name], attrs[(i,)] = value, [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], consts[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)

H, G, D, BS = 16, 2, 128, 16  # Gemma-3-27B: 16 KV heads, 2 query heads each, head_dim 128
for dt in ("bf16", "fp32"):
    p = "*" + dt
    prec = "ieee" if dt == "fp32" else "tf32"
    strides = dict(s_cp=2 * 2 * BS * H * D, s_ckv=BS * H * D, s_cs=H * D, s_ch=D, s_cd=1, s_tr=512, s_tb=1,
                   s_tsc=5 * 256 * 512)  # (the scales' table: five planes on, where they lie apart)
    qo = dict(s_qt=H * G * D, s_qh=D, s_qd=1, s_ot=H * G * D, s_oh=D, s_od=1)
    scale_strides = dict(s_sp=2 * 2 * BS * H, s_skv=BS * H, s_ss=H, s_sh=1)
    common = dict(q_ptr=p, out_ptr=p, cache_ptr=p, table_ptr="*i64", table_rows_ptr="*i64", first_ptr="*i64",
                  sinks_ptr="*fp32", scales_ptr="*fp32", scale=0.1, softcap=0.0, max_blocks=512, **qo, **strides,
                  **scale_strides)
    # The tiles kernel_attention.decode_block_n picks: 128 (full) and 32 (window) keys in 16-bit, 64 else.
    # (sinks: gpt-oss's windowed layers, split and not)
    for softcap, sinks, splits, block_n in ((False, False, 1, 128), (True, False, 4, 32), (False, False, 2, 64),
                                            (False, True, 1, 32), (False, True, 4, 128)):
        compile(ops._paged_decode_kernel, dict(common, rows_ptr="*i64", qpos_ptr="*i64", part_acc_ptr="*fp32",
                part_m_ptr="*fp32", part_l_ptr="*fp32"), dict(HAS_SOFTCAP=softcap, HAS_SINKS=sinks, BLOCK_SIZE=BS,
                GROUP=G, GROUP_PAD=16, HEAD_DIM=D, DIM_PAD=D, BLOCK_N=block_n if dt == "bf16" else 64,
                SPLITS=splits, PRECISION=prec, CODES=False))
    for softcap, sinks, dot16 in ((False, False, False), (True, False, False), (False, False, dt == "bf16"),
                                  (False, True, False)):
        compile(ops._paged_prefill_kernel, dict(common, start_ptr="*i64", len_ptr="*i64", pos_ptr="*i64"),
                dict(HAS_SOFTCAP=softcap, HAS_SINKS=sinks, BLOCK_SIZE=BS, GROUP=G, HEAD_DIM=D, DIM_PAD=D,
                     BLOCK_M=16 if dt == "fp32" else 32, BLOCK_N=32 if dt == "fp32" else 64, PRECISION=prec,
                     DOT_16=dot16, CODES=False),
                num_warps=4 if dt == "fp32" else 8)
    # int8 and float8 codes with their scales (kv_quant.py), read by bfloat16 and float32 queries
    for codes in ("*i8", "*fp8e4nv", "*fp8e5"):
        compile(ops._paged_decode_kernel, dict(common, cache_ptr=codes, rows_ptr="*i64", qpos_ptr="*i64",
                part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32"), dict(HAS_SOFTCAP=False,
                HAS_SINKS=False, BLOCK_SIZE=BS, GROUP=G, GROUP_PAD=16, HEAD_DIM=D, DIM_PAD=D, BLOCK_N=64, SPLITS=1,
                PRECISION="tf32", CODES=True))
        compile(ops._paged_prefill_kernel, dict(common, cache_ptr=codes, start_ptr="*i64", len_ptr="*i64",
                pos_ptr="*i64"), dict(HAS_SOFTCAP=False, HAS_SINKS=False, BLOCK_SIZE=BS, GROUP=G, HEAD_DIM=D,
                DIM_PAD=D, BLOCK_M=32, BLOCK_N=64, PRECISION="tf32", DOT_16=False, CODES=True), num_warps=8)
    for code_max, mantissa, bias in ((127.0, 0, 0), (448.0, 3, 7), (57344.0, 2, 15)):
        compile(ops._store_codes_kernel, dict(k_ptr=p, v_ptr=p, codes_ptr="*u8", scales_ptr="*fp32",
                slot_ptr="*i64", scale_slot_ptr="*i64", s_kt=H * D, s_kh=D, s_kd=1, s_vt=H * D, s_vh=D, s_vd=1, num_heads=H, **strides,
                **scale_strides), dict(BLOCK_SIZE=BS, HEAD_DIM=D, HEADS_TILE=16, DIM_PAD=D, CODE_MAX=code_max,
                MANTISSA=mantissa, BIAS=bias))
    compile(ops._combine_splits_kernel, dict(out_ptr=p, rows_ptr="*i64", part_acc_ptr="*fp32", part_m_ptr="*fp32",
            part_l_ptr="*fp32", s_ot=H * G * D, s_oh=D, s_od=1, num_q_heads=H * G),
            dict(HEAD_DIM=D, DIM_PAD=D, SPLITS=4, SPLITS_PAD=4))
    compile(ops._store_kv_kernel, dict(k_ptr=p, v_ptr=p, cache_ptr=p, slot_ptr="*i64", s_kt=H * D, s_kh=D, s_kd=1,
            s_vt=H * D, s_vh=D, s_vd=1, num_heads=H, **strides), dict(BLOCK_SIZE=BS, HEAD_DIM=D, HEADS_TILE=16,
            DIM_PAD=D))
I, N = 8192, 16  # Jamba-1.5-Mini's Mamba layer
pages = dict(read_ptr="*i64", write_ptr="*i64", zero_ptr="*i8", base=1000, page_elems=65536, channels=I,
             s_rr=123, s_rw=1, s_wr=123, s_ww=1)
compile(ops._conv_step_kernel, dict(x_ptr="*bf16", y_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", pool_ptr="*bf16",
        s_xr=I, s_xi=1, s_yr=I, s_yi=1, s_wi=4, s_wk=1, **pages),
        dict(WIDTH=4, WIDTH_PAD=4, BLOCK_I=128, HAS_BIAS=True, SILU=True))
compile(ops._ssm_step_kernel, dict(x_ptr="*bf16", dt_ptr="*fp32", a_ptr="*fp32", b_ptr="*fp32", c_ptr="*fp32",
        d_ptr="*fp32", gate_ptr="*fp32", y_ptr="*fp32", pool_ptr="*fp32", s_xr=I, s_xi=1, s_dtr=I, s_dti=1, s_ai=N,
        s_an=1, s_br=N, s_bn=1, s_cr=N, s_cn=1, s_gr=I, s_gi=1, s_yr=I, s_yi=1, **pages),
        dict(STATE=N, STATE_PAD=N, BLOCK_I=128, HAS_D=True, HAS_GATE=True))
D, INTER = 256, 6912  # Gemma-3-1B: head_dim, MLP width
compile(ops._norm_rotary_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", out_ptr="*bf16",
        dim=D, s_xt=6 * D, s_xh=D, s_ot=4 * D, s_oh=D, s_ct=D, s_st=D, offset=1.0, eps=1e-6),
        dict(BLOCK_D=D, HAS_WEIGHT=True, ROUND_BEFORE_SCALE=False, ROTATE=True))
compile(ops._gated_activation_kernel, dict(in_ptr="*bf16", out_ptr="*bf16", inter=INTER, s_ir=2 * INTER, s_or=INTER),
        dict(GELU_TANH=True, BLOCK=1024))
L = 64
compile(ops._selective_scan_kernel, dict(x_ptr="*bf16", dt_ptr="*bf16", a_ptr="*fp32", b_ptr="*bf16", c_ptr="*bf16",
        h0_ptr="*fp32", len_ptr="*i64", y_ptr="*fp32", h_ptr="*fp32", channels=I, s_xr=L * I, s_xt=I, s_xi=1,
        s_dr=L * I, s_dt=I, s_di=1, s_ai=N, s_an=1, s_br=L * N, s_bt=N, s_bn=1, s_cr=L * N, s_ct=N, s_cn=1,
        s_h0r=I * N, s_h0i=N, s_h0n=1, s_yr=L * I, s_yt=I, s_yi=1, s_hr=I * N, s_hi=N, s_hn=1),
        dict(STATE=N, STATE_PAD=N, BLOCK_I=32))
print("compiled")
"""


def _nvidia_compiler_available():
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_compiler_available(), reason="this triton build has no NVIDIA compiler backend")
def test_every_kernel_compiles_for_an_h100():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9 warns when unset
    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, "-c", AOT], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# -- real sizes, on a GPU ----------------------------------------------------------
GEMMA3_27B = dict(q_heads=32, group=2, dim=128, scale=168 ** -0.5, window=1024)  # models/gemma-3-27b.json


def real_size_step(context, batch, seed=0):
    """`batch` decodes whose positions spread over the last 512 of `context`."""
    rng = np.random.default_rng(seed)
    return [(int(context - 1 - rng.integers(0, 512)), 1) for _ in range(batch)]


@gpu_only
@pytest.mark.slow
@pytest.mark.parametrize("context", [8192, 32768])
@pytest.mark.parametrize("kind", ["full", "sliding_window"])
def test_real_size_gemma3_27b_decode_batch_64(context, kind):
    g = GEMMA3_27B
    case = AttentionCase(kind, g["window"], 16, g["group"], torch.bfloat16, dim=g["dim"], q_heads=g["q_heads"],
                         step=real_size_step(context, 64), layers_per_page=2 if context <= 8192 else 1,
                         poison=False)
    check_attention(case, scale=g["scale"], softcap=None, direct=False)


@gpu_only
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "sliding_window"])
def test_real_size_gemma3_27b_mixed_prefill_and_decodes(kind):
    # A 2048-token chunk after 6144 cached tokens, beside 32 decodes at 8K.
    g = GEMMA3_27B
    step = [(6144, 2048)] + real_size_step(8192, 32, seed=1)
    case = AttentionCase(kind, g["window"], 16, g["group"], torch.bfloat16, dim=g["dim"], q_heads=g["q_heads"],
                         step=step, poison=False)
    check_attention(case, scale=g["scale"], softcap=None, direct=False)


@gpu_only
@pytest.mark.slow
def test_real_size_jamba_1_5_mini_mamba_decode_step():
    # The layout's own page size and the offsets of a middle Mamba layer.
    specs = specs_from_config(load_config(os.path.join(MODELS, "jamba-1.5-mini.json")), dtype="bfloat16")
    layout = plan_layout(specs, 8 << 30, block_size=16)
    name = sorted(n for n, v in layout.layer_views.items() if layout.groups[v.group].kind == "mamba")[13]
    view = layout.layer_views[name]
    group = layout.groups[view.group]
    (conv_shape, ssm_shape) = group.spec.shapes
    case = MambaCase(torch.bfloat16, torch.bfloat16, channels=conv_shape[0], conv_width=conv_shape[1] + 1,
                     state=ssm_shape[1], page=layout.page_size_bytes, width=group.pages_per_block,
                     conv_offset=view.offset + view.part_offsets[0], ssm_offset=view.offset + view.part_offsets[1])
    check_mamba_step(case, torch.bfloat16)


def test_the_startup_self_test_passes_and_catches_a_broken_kernel(monkeypatch):
    from hybridkv.layers.backends.triton import check as kernel_check

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernel_check.check(ops, device)  # the kernels agree with the dense rules

    class Broken:  # a decode kernel that reads one key too many below the window
        def __getattr__(self, name):
            return getattr(ops, name)

        def paged_decode_attention(self, out, q, cache, rows, table, table_rows, q_pos, first_key, **kw):
            return ops.paged_decode_attention(out, q, cache, rows, table, table_rows, q_pos,
                                              (first_key - 1).clamp(min=0), **kw)

    with pytest.raises(AssertionError, match="decode attention"):
        kernel_check.check(Broken(), device)

    class NoSinks(Broken):  # a decode kernel that drops the attention sinks
        def paged_decode_attention(self, *args, sinks=None, **kw):
            return ops.paged_decode_attention(*args, **kw)

    with pytest.raises(AssertionError, match="decode attention"):
        kernel_check.check(NoSinks(), device)
