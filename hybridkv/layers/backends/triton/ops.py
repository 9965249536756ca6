"""Triton kernels for the paged hybrid cache: K/V store, paged attention
(decode and prefill / mixed batches) and the Mamba decode step, reading and
writing the pool in place.

They compute what the reference backend and `mamba_ops.py` compute (the torch
reference, their oracle) without gathering: every program follows the block
table itself. Importing this module decorates the kernels, and triton reads
`TRITON_INTERPRET` at that moment: set it to 1 *before* the import to run
them on CPU tensors under triton's interpreter (that is how the tests run
them; `backends/triton/__init__.py` imports this module only when the
backend is built).

Conventions shared by the kernels:

* A layer's K/V cache is the strided view `[pages, 2, block_size, kv_heads,
  head_dim]` of the shared byte pool; the page stride is the pool's page
  size in elements (other layers' bytes sit between two pages of this
  layer), so every kernel takes strides and assumes no contiguity.
* Page ids are int64 and every address that involves a page is computed in
  int64: a pool of tens of GiB overflows int32 element offsets.
* A query reads the keys from `first_key` (the first position its layer's
  read rule lets it see: `spec.first_visible`, core/specs.py, computed by the
  caller) to its own position; the kernels know no layer types. Block
  tables start at key position 0, one row per running sequence (a
  persistent table), and a request names its row (`table_rows`). A key
  outside the range is never loaded, so the null page (page 0), which
  stands in the table for blocks a layer has released, is never read.
* Scores and sums are float32 whatever the cache dtype: 16-bit values are
  converted after the load (triton's interpreter cannot do bf16 arithmetic,
  and on a GPU the float32 accumulation is what the reference does too).
* Attention sinks (`sinks`, a float32 logit per query head, gpt-oss) start
  the online softmax: the running max at the sink and the running sum at
  1, its weight, with no value added (in a decode split into several
  programs, the first split's). A sink is one more term of the denominator.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...kv_quant import QuantizedCache

# Whether the kernels below run under triton's interpreter (decided now, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(int(n)))


def _check_tile(size: int) -> None:
    # tl.arange needs a power of two; tl.dot on a GPU needs at least 16.
    if size < 16 or size & (size - 1):
        raise ValueError(f"tile sizes must be powers of two of at least 16, got {size}")


def _launch(num_warps: int | None, num_stages: int | None) -> dict:
    """Launch options a caller (the benchmark's sweep) may set; triton's
    defaults otherwise."""
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 data needs a true float32 dot ("ieee"); values that came from
    # 16-bit types fit tf32's 10-bit mantissa exactly, so tf32 tensor cores
    # lose nothing on the Q.K products (P.V rounds P to tf32, well inside
    # the 16-bit tolerance).
    return "ieee" if dtype == torch.float32 else "tf32"


# -- store -------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                     s_cp, s_ckv, s_cs, s_ch, s_cd,
                     num_heads,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_TILE: tl.constexpr,
                     DIM_PAD: tl.constexpr):
    """One program per (token, tile of KV heads): K and V rows to their slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # -1 marks a padding token: nothing to store
        page = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.program_id(1) * HEADS_TILE + tl.arange(0, HEADS_TILE)
        d = tl.arange(0, DIM_PAD)
        mask = (h < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
        dst = cache_ptr + page * s_cp + offset * s_cs + h[:, None] * s_ch + d[None, :] * s_cd
        k = tl.load(k_ptr + t * s_kt + h[:, None] * s_kh + d[None, :] * s_kd, mask=mask)
        v = tl.load(v_ptr + t * s_vt + h[:, None] * s_vh + d[None, :] * s_vd, mask=mask)
        tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + s_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write K and V rows (`[tokens, kv_heads, head_dim]`) into `cache`
    (`[pages, 2, block_size, kv_heads, head_dim]`, any strides) at `slots`
    (`[tokens]` int64, page * block_size + offset; -1 = padding, skipped)."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    bs = cache.shape[2]
    dim_pad = _pow2(dim)
    heads_tile = min(_pow2(heads), max(1, 4096 // dim_pad))
    grid = (tokens, triton.cdiv(heads, heads_tile))
    _store_kv_kernel[grid](k, v, cache, slots, *k.stride(), *v.stride(), *cache.stride(), heads,
                           BLOCK_SIZE=bs, HEAD_DIM=dim, HEADS_TILE=heads_tile, DIM_PAD=dim_pad)


@triton.jit
def _round_even(x):
    """x (|x| < 2^22) rounded to the nearest integer, ties to even: float32
    addition of 1.5 * 2^23 rounds there (as torch.round; no libdevice
    needed, so the interpreter runs it too)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _float8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """float8 codes of x (|x| at most the type's largest) as uint8 bits,
    rounded to the nearest even as torch converts: normal values by
    rounding float32's mantissa to the type's (a carry moves the exponent),
    smaller ones in steps of the least subnormal. (Triton's own conversion
    rounds otherwise under the interpreter.)"""
    a = tl.abs(x)
    subnormal = _round_even(a * (2.0 ** (BIAS - 1 + MANTISSA))).to(tl.uint32)
    bits = a.to(tl.uint32, bitcast=True)
    shift: tl.constexpr = 23 - MANTISSA
    bits = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    normal = (bits >> shift) - ((127 - BIAS) << MANTISSA)
    code = tl.where(a < 2.0 ** (1 - BIAS), subnormal, normal)
    return (code | tl.where(x < 0.0, 0x80, 0).to(tl.uint32)).to(tl.uint8)


@triton.jit
def _store_codes_kernel(k_ptr, v_ptr, codes_ptr, scales_ptr, slot_ptr, scale_slot_ptr,
                        s_kt, s_kh, s_kd, s_vt, s_vh, s_vd,
                        s_cp, s_ckv, s_cs, s_ch, s_cd,
                        s_sp, s_skv, s_ss, s_sh,
                        num_heads,
                        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_TILE: tl.constexpr,
                        DIM_PAD: tl.constexpr, CODE_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                        BIAS: tl.constexpr):
    """One program per (token, tile of KV heads): K and V rows to their slot
    as 8-bit codes and a float32 scale each (kv_quant.py's quantize: scale =
    the row's largest magnitude / CODE_MAX; int8 codes where MANTISSA is 0,
    else float8 with that many mantissa bits; codes written as their bits).
    The scales go to the slots `scale_slot_ptr` names (the codes' own where
    they share pages; the same offset in a block, another page where the
    layout keeps them apart)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        page = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        scale_page = tl.load(scale_slot_ptr + t) // BLOCK_SIZE
        h = tl.program_id(1) * HEADS_TILE + tl.arange(0, HEADS_TILE)
        d = tl.arange(0, DIM_PAD)
        h_ok = h < num_heads
        mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
        dst = codes_ptr + page * s_cp + offset * s_cs + h[:, None] * s_ch + d[None, :] * s_cd
        scale_dst = scales_ptr + scale_page * s_sp + offset * s_ss + h * s_sh
        for half in tl.static_range(2):
            if half == 0:
                x = tl.load(k_ptr + t * s_kt + h[:, None] * s_kh + d[None, :] * s_kd, mask=mask, other=0.0)
            else:
                x = tl.load(v_ptr + t * s_vt + h[:, None] * s_vh + d[None, :] * s_vd, mask=mask, other=0.0)
            x = x.to(tl.float32)
            # IEEE divisions (div_rn; a GPU's `/` is approximate), so that the codes are torch's bit for bit
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), CODE_MAX)
            q = tl.math.div_rn(x, tl.where(scale > 0.0, scale, 1.0)[:, None])
            q = tl.minimum(tl.maximum(q, -CODE_MAX), CODE_MAX)
            if MANTISSA == 0:
                code = _round_even(q).to(tl.int8).to(tl.uint8, bitcast=True)
            else:
                code = _float8_bits(q, MANTISSA, BIAS)
            tl.store(dst + half * s_ckv, code, mask=mask)
            tl.store(scale_dst + half * s_skv, scale, mask=h_ok)


# The 8-bit page types: the largest code (kv_quant.py) and the float8 fields.
_CODES = {torch.int8: (127.0, 0, 0), torch.float8_e4m3fn: (448.0, 3, 7), torch.float8_e5m2: (57344.0, 2, 15)}


def store_codes(codes: torch.Tensor, scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slots: torch.Tensor, scale_slots: torch.Tensor | None = None) -> None:
    """Write K and V rows (`[tokens, kv_heads, head_dim]`, already rotated
    where the page type is) into a quantized layer's `codes` (`[pages, 2,
    block_size, kv_heads, head_dim]`, int8 or float8) and `scales`
    (`[pages, 2, block_size, kv_heads]`, float32) at `slots` (-1: skipped),
    the scales at `scale_slots` where they lie in pages of their own."""
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    code_max, mantissa, bias = _CODES[codes.dtype]
    dim_pad = _pow2(dim)
    heads_tile = min(_pow2(heads), max(1, 4096 // dim_pad))
    grid = (tokens, triton.cdiv(heads, heads_tile))
    _store_codes_kernel[grid](k, v, codes.view(torch.uint8), scales, slots,
                              slots if scale_slots is None else scale_slots, *k.stride(), *v.stride(),
                              *codes.stride(), *scales.stride(), heads, BLOCK_SIZE=codes.shape[2], HEAD_DIM=dim,
                              HEADS_TILE=heads_tile, DIM_PAD=dim_pad, CODE_MAX=code_max, MANTISSA=mantissa,
                              BIAS=bias)


# -- paged attention -----------------------------------------------------------
def _pages(cache) -> tuple[torch.Tensor, torch.Tensor, tuple, bool]:
    """What the attention kernels read of a layer's cache: its values (or a
    quantized layer's codes), its scales with their strides (a stand-in the
    kernels never read otherwise), and whether there are codes."""
    if isinstance(cache, QuantizedCache):
        return cache.codes, cache.scales, cache.scales.stride(), True
    return cache, cache, (0, 0, 0, 0), False


def _scale_shift(tables: torch.Tensor, scale_tables: torch.Tensor | None) -> int:
    """Elements from a row of the codes' table to the same row of the
    scales' (planes of one table: the block's page columns); 0 where the
    scales share the codes' pages."""
    if scale_tables is None:
        return 0
    if scale_tables.stride() != tables.stride() or scale_tables.dtype != tables.dtype:
        raise ValueError("the scales' table must be another plane of the codes' table (same strides and dtype)")
    return (scale_tables.data_ptr() - tables.data_ptr()) // tables.element_size()


def _sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (float32, one per query head), or
    a stand-in pointer they never read (HAS_SINKS off)."""
    if sinks is None:
        return q
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be one per query head ({q.shape[1]}), got {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous()


@triton.jit
def _key_tile_scores(q, table_row, s_tb, s_tsc, n, ok, cache_ptr, kv_head, d, d_ok, s_cp, s_cs, s_ch, s_cd,
                     scales_ptr, s_sp, s_ss, s_sh,
                     scale, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     PRECISION: tl.constexpr, DOT_16: tl.constexpr, CODES: tl.constexpr):
    """Scores of the query rows `q` against the keys `n` of a table row (only
    where `ok`: a key outside is never loaded), in base 2 for exp2, and the
    pointers and mask to load the same rows of V, and (CODES) the pointers
    to their scales. DOT_16: the dot takes the 16-bit K as stored (and `q`
    in the same type), accumulating in float32; else K is widened to
    float32 first. CODES: the cache holds 8-bit codes, each key's score
    their dot product times its scale (scales [pages, 2, block_size,
    kv_heads], float32), their pages `s_tsc` elements on from the codes'
    in the table (_scale_shift)."""
    page = tl.load(table_row + (n // BLOCK_SIZE) * s_tb, mask=ok, other=0).to(tl.int64)
    kv_ptrs = (cache_ptr + page[:, None] * s_cp + (n % BLOCK_SIZE)[:, None] * s_cs + kv_head * s_ch
               + d[None, :] * s_cd)
    kv_mask = ok[:, None] & d_ok[None, :]
    scale_page = page
    if CODES:
        scale_page = tl.load(table_row + s_tsc + (n // BLOCK_SIZE) * s_tb, mask=ok, other=0).to(tl.int64)
    scale_ptrs = scales_ptr + scale_page * s_sp + (n % BLOCK_SIZE) * s_ss + kv_head * s_sh
    k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
    if DOT_16:
        s = tl.dot(q, tl.trans(k)) * scale
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
    if CODES:
        s = s * tl.load(scale_ptrs, mask=ok, other=0.0)[None, :]
    if HAS_SOFTCAP:
        # softcap * tanh(s / softcap), tanh written with exp (the interpreter
        # has no tanh); it saturates to +-1, no overflow.
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * 1.4426950408889634, kv_ptrs, kv_mask, scale_ptrs


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, kv_ptrs, kv_mask, s_ckv, scale_ptrs, s_skv, ok,
                         PRECISION: tl.constexpr, DOT_16: tl.constexpr, CODES: tl.constexpr):
    """Fold one tile of (already masked, base-2) scores into the running
    max, sum and weighted sum of V (DOT_16: P rounded to V's 16-bit type for
    the dot, as flash attention does on tensor cores; CODES: each weight
    times its V row's scale, the sum the weights' own)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(kv_ptrs + s_ckv, mask=kv_mask, other=0.0)
    if DOT_16:
        pv = tl.dot(p.to(v.dtype), v)
    elif CODES:
        pv = tl.dot(p * tl.load(scale_ptrs + s_skv, mask=ok, other=0.0)[None, :], v.to(tl.float32),
                    input_precision=PRECISION)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _softmax_start(sinks_ptr, heads, ok, rows: tl.constexpr, HAS_SINKS: tl.constexpr, with_sink):
    """The online softmax's running max and sum before any key: with a sink
    (where `with_sink`), the sink's base-2 logit and its weight 1; else a
    finite low max (a tile with no visible key then gives exp2(-inf -
    finite) = 0, not NaN) and 0."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(with_sink, sink, tl.full([rows], -1e30, tl.float32))
        l_i = tl.where(with_sink, tl.full([rows], 1.0, tl.float32), tl.zeros([rows], tl.float32))
    else:
        m_i = tl.full([rows], -1e30, tl.float32)
        l_i = tl.zeros([rows], tl.float32)
    return m_i, l_i


@triton.jit
def _paged_decode_kernel(q_ptr, out_ptr, cache_ptr, rows_ptr, table_ptr, table_rows_ptr, qpos_ptr, first_ptr,
                         sinks_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, scales_ptr,
                         scale, softcap, max_blocks,
                         s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
                         s_cp, s_ckv, s_cs, s_ch, s_cd,
                         s_sp, s_skv, s_ss, s_sh,
                         s_tr, s_tb, s_tsc,
                         HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         PRECISION: tl.constexpr, CODES: tl.constexpr):
    """One program per (request, KV head, split of the keys): the GROUP query
    heads that share the KV head are the rows of one tile, so each K/V row
    is loaded once for all of them (GQA). Online softmax over tiles of
    BLOCK_N keys, from the query's first visible key to its own; each key's
    page comes from the request's table row (tiles may cross blocks). With
    SPLITS > 1 each program covers a slice of the keys and leaves (acc, max,
    sum) for `_combine_splits_kernel` (flash-decoding: enough programs to
    fill the GPU when the batch is small)."""
    r = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + r).to(tl.int64)
    lo = tl.load(first_ptr + r)
    hi = tl.load(qpos_ptr + r)  # inclusive: the query's own key was just stored
    first_tile = lo // BLOCK_N * BLOCK_N
    tiles = (hi - first_tile) // BLOCK_N + 1
    per_split = (tiles + SPLITS - 1) // SPLITS
    start = first_tile + split * per_split * BLOCK_N
    stop = tl.minimum(start + per_split * BLOCK_N, hi + 1)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * s_qt + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m_i, l_i = _softmax_start(sinks_ptr, heads, g_ok, GROUP_PAD, HAS_SINKS, split == 0)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = table_ptr + tl.load(table_rows_ptr + r).to(tl.int64) * s_tr
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = (n >= lo) & (n < stop) & (n // BLOCK_SIZE < max_blocks)
        s, kv_ptrs, kv_mask, scale_ptrs = _key_tile_scores(q, table_row, s_tb, s_tsc, n, ok, cache_ptr, kv_head, d,
                                                           d_ok, s_cp, s_cs, s_ch, s_cd, scales_ptr, s_sp, s_ss, s_sh,
                                                           scale, softcap, HAS_SOFTCAP, BLOCK_SIZE, PRECISION, False,
                                                           CODES)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, kv_ptrs, kv_mask, s_ckv, scale_ptrs, s_skv, ok,
                                             PRECISION, False, CODES)

    out_mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row * s_ot + heads[:, None] * s_oh + d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials laid out [request, q head, split, (dim)], contiguous.
        part = (r * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=out_mask)
        tl.store(part_m_ptr + part, m_i, mask=g_ok)
        tl.store(part_l_ptr + part, l_i, mask=g_ok)


@triton.jit
def _combine_splits_kernel(out_ptr, rows_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                           s_ot, s_oh, s_od, num_q_heads,
                           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
                           SPLITS_PAD: tl.constexpr):
    """One program per (request, query head): rescale each split's partial
    sums to the common max and normalise."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (r * num_q_heads + h) * SPLITS + sp
    sp_ok = sp < SPLITS
    m = tl.load(part_m_ptr + part, mask=sp_ok, other=-1e30)
    l = tl.load(part_l_ptr + part, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + d[None, :], mask=sp_ok[:, None], other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * s_ot + h * s_oh + d * s_od, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                           tables: torch.Tensor, table_rows: torch.Tensor, query_pos: torch.Tensor,
                           first_key: torch.Tensor, *, scale: float, softcap: float | None = None,
                           sinks: torch.Tensor | None = None, splits: int = 1, block_n: int = 64,
                           num_warps: int | None = None, num_stages: int | None = None,
                           scale_tables: torch.Tensor | None = None) -> None:
    """Attention of one query token per request through its block table.

    q, out: `[tokens, q_heads, head_dim]`; request i's query is row
    `rows[i]`, at position `query_pos[i]`, and reads keys `first_key[i]` ..
    `query_pos[i]`; its blocks are row `table_rows[i]` of `tables` (`[rows,
    blocks]` int64, this layer's column, from key position 0). Entries
    outside the range may be anything, the null page included: they are not
    read. Writes `out[rows]`. `sinks` (`[q_heads]`, float32): attention
    sinks, one more logit per query head in the softmax's denominator.
    `scale_tables`: a quantized layer's scales' column of the same table,
    where they lie in pages of their own (None: the codes' pages).

    splits > 1 divides each request's keys among that many programs
    (flash-decoding) and adds a small combining kernel; block_n (a power of
    two, at least 16) is the keys per tile, which may cross blocks. Every
    argument is a tensor or a shape-derived int: the launch can be captured
    in a CUDA graph.
    """
    _check_tile(block_n)
    requests = rows.shape[0]
    if requests == 0:
        return
    _, _, bs, kv_heads, dim = cache.shape
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    dim_pad = _pow2(dim, 16)
    # tl.dot needs at least 16 rows: pad the GQA group (decode is bound by
    # reading K/V, the idle rows cost no memory traffic).
    group_pad = _pow2(group, 16)
    if splits > 1:
        parts = requests * q_heads * splits
        part_acc = torch.empty(parts, dim_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty(parts, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_m = part_l = out  # unused
    pages, scales, scale_strides, codes = _pages(cache)
    _paged_decode_kernel[(requests, kv_heads, splits)](
        q, out, pages, rows, tables, table_rows, query_pos, first_key, _sinks(sinks, q), part_acc, part_m, part_l,
        scales, float(scale), float(softcap or 0.0), tables.shape[1],
        *q.stride(), *out.stride(), *pages.stride(), *scale_strides, *tables.stride(),
        _scale_shift(tables, scale_tables),
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, BLOCK_SIZE=bs, GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=dim, DIM_PAD=dim_pad, BLOCK_N=block_n, SPLITS=splits, PRECISION=_dot_precision(pages.dtype),
        CODES=codes, **_launch(num_warps, num_stages))
    if splits > 1:
        _combine_splits_kernel[(requests, q_heads)](
            out, rows, part_acc, part_m, part_l, *out.stride(), q_heads,
            HEAD_DIM=dim, DIM_PAD=dim_pad, SPLITS=splits, SPLITS_PAD=_pow2(splits))


@triton.jit
def _paged_prefill_kernel(q_ptr, out_ptr, cache_ptr, start_ptr, len_ptr, table_ptr, table_rows_ptr, pos_ptr,
                          first_ptr, sinks_ptr, scales_ptr,
                          scale, softcap, max_blocks,
                          s_qt, s_qh, s_qd, s_ot, s_oh, s_od,
                          s_cp, s_ckv, s_cs, s_ch, s_cd,
                          s_sp, s_skv, s_ss, s_sh,
                          s_tr, s_tb, s_tsc,
                          HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                          DOT_16: tl.constexpr, CODES: tl.constexpr):
    """One program per (segment, tile of BLOCK_M query tokens, query head).
    A segment is one request's consecutive query tokens (a prefill chunk
    that may continue after cached tokens, or a single decode token). The
    tile reads keys from the first one visible to its first query (the
    first visible key never moves back as the position grows) up to its
    last query; the mask is exact per (query, key)."""
    seg = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    length = tl.load(len_ptr + seg)
    if m0 < length:
        first_row = tl.load(start_ptr + seg).to(tl.int64)
        kv_head = head // GROUP
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < length
        q_pos = tl.load(pos_ptr + first_row + m, mask=m_ok, other=0)
        q_first = tl.load(first_ptr + first_row + m, mask=m_ok, other=0)
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + (first_row + m)[:, None] * s_qt + head * s_qh + d[None, :] * s_qd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_16:
            q = q.to(cache_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        lo = tl.load(first_ptr + first_row + m0)
        hi = tl.load(pos_ptr + first_row + tl.minimum(m0 + BLOCK_M, length) - 1)  # the tile's last query
        m_i, l_i = _softmax_start(sinks_ptr, head + tl.zeros([BLOCK_M], tl.int32), m_ok, BLOCK_M, HAS_SINKS, True)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        table_row = table_ptr + tl.load(table_rows_ptr + seg).to(tl.int64) * s_tr
        for n0 in range(lo // BLOCK_N * BLOCK_N, hi + 1, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            ok = (n >= lo) & (n <= hi) & (n // BLOCK_SIZE < max_blocks)
            s, kv_ptrs, kv_mask, scale_ptrs = _key_tile_scores(q, table_row, s_tb, s_tsc, n, ok, cache_ptr, kv_head, d,
                                                               d_ok, s_cp, s_cs, s_ch, s_cd, scales_ptr, s_sp, s_ss,
                                                               s_sh, scale, softcap, HAS_SOFTCAP, BLOCK_SIZE,
                                                               PRECISION, DOT_16, CODES)
            seen = ok[None, :] & (n[None, :] <= q_pos[:, None]) & (n[None, :] >= q_first[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, kv_ptrs, kv_mask, s_ckv, scale_ptrs, s_skv, ok,
                                                 PRECISION, DOT_16, CODES)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + (first_row + m)[:, None] * s_ot + head * s_oh + d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, starts: torch.Tensor,
                            lengths: torch.Tensor, tables: torch.Tensor, table_rows: torch.Tensor,
                            positions: torch.Tensor, first_key: torch.Tensor, *, max_length: int, scale: float,
                            softcap: float | None = None, sinks: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            dot_16bit: bool | None = None, scale_tables: torch.Tensor | None = None) -> None:
    """Attention of segments of consecutive query tokens (prefill chunks,
    also after cached tokens; a mixed batch's decodes are segments of one).

    Segment i is rows `starts[i] .. starts[i] + lengths[i] - 1` of q/out; its
    blocks are row `table_rows[i]` of `tables` (`[rows, blocks]`, from key
    position 0). Query row t sits at `positions[t]` and reads keys
    `first_key[t]` .. `positions[t]`. `max_length` (a Python int, no device
    sync) sizes the grid. `sinks` as `paged_decode_attention`'s. block_m
    queries and block_n keys per tile (powers of two, at least 16). `dot_16bit` (16-bit caches, compiled kernels
    only; the default there): the dots take Q, K, P and V in the cache's
    16-bit type, float32 accumulation, instead of widening to float32 tiles
    first. `scale_tables` as `paged_decode_attention`'s.
    """
    pages, scales, scale_strides, codes = _pages(cache)
    if dot_16bit is None:
        dot_16bit = pages.element_size() == 2 and not INTERPRETED
    head_dim = cache.shape[-1]
    if pages.element_size() >= 4:
        # float32 dots run on FMA units ("ieee"): 32 x 64 tiles spill
        # registers on sm_90 (ptxas -v), 16 x 32 do not.
        block_m, block_n = block_m or 16, block_n or 32
    elif dot_16bit and head_dim <= 128:
        # H100, Gemma-3-27B heads, 2048 queries after 6144 keys
        # (benchmarks/kernels.py's sweep, 2026-11-27): 64 x 64 tiles, 4 warps,
        # 2 stages ran full attention in 1,345 us and the sliding window in
        # 208, against 4,447 and 700 for 32 x 64 float32 tiles at 8 warps.
        block_m, block_n = block_m or 64, block_n or 64
        num_warps, num_stages = num_warps or 4, num_stages or 2
    else:
        # 16-bit, wider heads or float32 tiles: 32 x 64 tiles fit 255
        # registers at 4 warps, 138 at 8 (head_dim 128).
        block_m, block_n, num_warps = block_m or 32, block_n or 64, num_warps or 8
    _check_tile(block_m)
    _check_tile(block_n)
    if dot_16bit and (pages.element_size() != 2 or INTERPRETED):
        raise ValueError("dot_16bit takes a 16-bit cache and compiled kernels (the interpreter's 16-bit dots "
                         "are wrong)")
    segments = starts.shape[0]
    if segments == 0 or max_length == 0:
        return
    _, _, bs, kv_heads, dim = cache.shape
    q_heads = q.shape[1]
    grid = (segments, triton.cdiv(max_length, block_m), q_heads)
    _paged_prefill_kernel[grid](
        q, out, pages, starts, lengths, tables, table_rows, positions, first_key, _sinks(sinks, q), scales,
        float(scale), float(softcap or 0.0), tables.shape[1],
        *q.stride(), *out.stride(), *pages.stride(), *scale_strides, *tables.stride(),
        _scale_shift(tables, scale_tables),
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None, BLOCK_SIZE=bs, GROUP=q_heads // kv_heads,
        HEAD_DIM=dim, DIM_PAD=_pow2(dim, 16), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_dot_precision(pages.dtype), DOT_16=dot_16bit, CODES=codes, **_launch(num_warps, num_stages))


# -- Mamba decode step ---------------------------------------------------------
# A request's Mamba state is a byte string spread over its block's pages:
# byte b lives on page pages[b // page_size] at offset b % page_size. The
# kernels take the pool viewed as the part's element type, so element e of
# a part that starts at element `base` lives on page
# pages[(base + e) // page_elems] at element (base + e) % page_elems (an
# element never straddles pages: parts are 16-byte aligned).

@triton.jit
def _state_addr(pool_ptr, page_row_ptr, s_pw, base, e, page_elems, mask):
    slot = base + e
    page = tl.load(page_row_ptr + (slot // page_elems) * s_pw, mask=mask, other=0).to(tl.int64)
    return pool_ptr + page * page_elems + slot % page_elems


@triton.jit
def _conv_step_kernel(x_ptr, y_ptr, w_ptr, bias_ptr, pool_ptr, read_ptr, write_ptr, zero_ptr,
                      base, page_elems, channels,
                      s_xr, s_xi, s_yr, s_yi, s_wi, s_wk, s_rr, s_rw, s_wr, s_ww,
                      WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One program per (request, tile of channels). The conv state is
    [channels, WIDTH-1] (the inputs before this token, oldest first): the
    window is state + x; y = sum(window * w) (+ bias); the new state is the
    window without its oldest column, written to the write pages."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.arange(0, WIDTH_PAD)
    i_ok = i < channels
    x = tl.load(x_ptr + r * s_xr + i * s_xi, mask=i_ok, other=0.0).to(tl.float32)
    keep = WIDTH - 1  # columns of the stored state
    # A request with no state yet starts from zeros: it reads no channel.
    # (An integer bound, not a scalar boolean: the interpreter cannot AND
    # a loaded scalar boolean into a mask.)
    stored = channels * (1 - tl.load(zero_ptr + r).to(tl.int32))
    read_row = read_ptr + r * s_rr
    # window[:, j] = state[:, j] for j < keep, x for j == keep.
    in_state = (i < stored)[:, None] & (j < keep)[None, :]
    old = tl.load(_state_addr(pool_ptr, read_row, s_rw, base, i[:, None] * keep + j[None, :], page_elems, in_state),
                  mask=in_state, other=0.0).to(tl.float32)
    window = tl.where((j == keep)[None, :], x[:, None], old)
    w = tl.load(w_ptr + i[:, None] * s_wi + j[None, :] * s_wk, mask=i_ok[:, None] & (j < WIDTH)[None, :],
                other=0.0).to(tl.float32)
    y = tl.sum(window * w, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + i, mask=i_ok, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + r * s_yr + i * s_yi, y.to(y_ptr.dtype.element_ty), mask=i_ok)
    # new_state[:, j] = window[:, j + 1]: the old state shifted by one, x last.
    # Loaded again (same bytes, from cache) rather than shifting registers.
    shift = (i < stored)[:, None] & (j < keep - 1)[None, :]
    newer = tl.load(_state_addr(pool_ptr, read_row, s_rw, base, i[:, None] * keep + j[None, :] + 1, page_elems,
                                shift), mask=shift, other=0.0)
    new_state = tl.where((j == keep - 1)[None, :], x[:, None].to(newer.dtype), newer)
    out_mask = i_ok[:, None] & (j < keep)[None, :]
    tl.store(_state_addr(pool_ptr, write_ptr + r * s_wr, s_ww, base, i[:, None] * keep + j[None, :], page_elems,
                         out_mask), new_state.to(pool_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _state_tile(channels, STATE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_I: tl.constexpr):
    """A (request, channel tile) program's place in a Mamba-1 state [channels,
    STATE]: its request r, channels i, state columns n, their masks and the
    tile's."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    n = tl.arange(0, STATE_PAD)
    i_ok = i < channels
    n_ok = n < STATE
    return r, i, n, i_ok, n_ok, i_ok[:, None] & n_ok[None, :]


@triton.jit
def _ssm_step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, gate_ptr, y_ptr,
                     pool_ptr, read_ptr, write_ptr, zero_ptr, base, page_elems, channels,
                     s_xr, s_xi, s_dtr, s_dti, s_ai, s_an, s_br, s_bn, s_cr, s_cn, s_gr, s_gi, s_yr, s_yi,
                     s_rr, s_rw, s_wr, s_ww,
                     STATE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                     HAS_D: tl.constexpr, HAS_GATE: tl.constexpr):
    """One program per (request, tile of channels):
    h = exp(dt A) h + dt x B;  y = C . h (+ D x) (* silu(gate)).
    The state h [channels, STATE] is read from the read pages and written to
    the write pages (the same pages when the update is in place)."""
    r, i, n, i_ok, n_ok, tile = _state_tile(channels, STATE, STATE_PAD, BLOCK_I)
    stored = channels * (1 - tl.load(zero_ptr + r).to(tl.int32))  # 0: no state yet, start from zeros
    e = i[:, None] * STATE + n[None, :]
    h_mask = (i < stored)[:, None] & n_ok[None, :]
    h = tl.load(_state_addr(pool_ptr, read_ptr + r * s_rr, s_rw, base, e, page_elems, h_mask),
                mask=h_mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r * s_xr + i * s_xi, mask=i_ok, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + r * s_dtr + i * s_dti, mask=i_ok, other=0.0).to(tl.float32)
    A = tl.load(a_ptr + i[:, None] * s_ai + n[None, :] * s_an, mask=tile, other=0.0).to(tl.float32)
    B = tl.load(b_ptr + r * s_br + n * s_bn, mask=n_ok, other=0.0).to(tl.float32)
    C = tl.load(c_ptr + r * s_cr + n * s_cn, mask=n_ok, other=0.0).to(tl.float32)
    h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
    y = tl.sum(h * C[None, :], axis=1)
    if HAS_D:
        y += tl.load(d_ptr + i, mask=i_ok, other=0.0).to(tl.float32) * x
    if HAS_GATE:
        z = tl.load(gate_ptr + r * s_gr + i * s_gi, mask=i_ok, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + r * s_yr + i * s_yi, y.to(y_ptr.dtype.element_ty), mask=i_ok)
    tl.store(_state_addr(pool_ptr, write_ptr + r * s_wr, s_ww, base, e, page_elems, tile),
             h.to(pool_ptr.dtype.element_ty), mask=tile)


def _typed_pool(pool: torch.Tensor, dtype: torch.dtype, offset: int) -> tuple[torch.Tensor, int, int]:
    """The byte pool as `dtype` elements, a part's first element and the elements per page."""
    size = torch.empty(0, dtype=dtype).element_size()
    if offset % size or pool.shape[1] % size:
        raise ValueError(f"a {dtype} state part at byte {offset} of {pool.shape[1]}-byte pages is misaligned")
    return pool.view(dtype), offset // size, pool.shape[1] // size


def mamba_conv_step(pool: torch.Tensor, read_pages: torch.Tensor, write_pages: torch.Tensor,
                    zero: torch.Tensor, offset: int, state_dtype: torch.dtype, x: torch.Tensor,
                    weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True) -> torch.Tensor:
    """One token's depthwise causal conv for each of R requests, with the
    conv state `[channels, width-1]` (`state_dtype`) read from and written to
    the pool in place.

    pool: `[pages, page_size]` uint8; read_pages, write_pages: `[R, pages per
    block]` int64 (may be equal); zero: `[R]` bool, requests with no state
    yet (their read pages are ignored); offset: the conv part's byte offset
    in the state (LayerView.offset + part_offsets[0]); x: `[R, channels]`;
    weight: `[channels, width]`. Returns `[R, channels]` in x's dtype
    (after SiLU when `silu`)."""
    requests, channels = x.shape
    y = torch.empty_like(x)
    if requests == 0:
        return y
    width = weight.shape[1]
    typed, base, page_elems = _typed_pool(pool, state_dtype, offset)
    zero = zero.view(torch.int8) if zero.dtype == torch.bool else zero
    block_i = min(_pow2(channels), 128)
    _conv_step_kernel[(requests, triton.cdiv(channels, block_i))](
        x, y, weight, bias if bias is not None else weight, typed, read_pages, write_pages, zero,
        base, page_elems, channels, *x.stride(), *y.stride(), *weight.stride(), *read_pages.stride(),
        *write_pages.stride(), WIDTH=width, WIDTH_PAD=_pow2(width), BLOCK_I=block_i, HAS_BIAS=bias is not None,
        SILU=silu)
    return y


def mamba_ssm_step(pool: torch.Tensor, read_pages: torch.Tensor, write_pages: torch.Tensor, zero: torch.Tensor,
                   offset: int, state_dtype: torch.dtype, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """One token's selective-state update for each of R requests, with the
    SSM state `[channels, N]` (`state_dtype`) read from and written to the
    pool in place (pages, zero and offset as in `mamba_conv_step`).

    x, dt (after softplus), gate: `[R, channels]`; A: `[channels, N]`;
    B, C: `[R, N]`; D: `[channels]`. Returns float32 `[R, channels]`:
    `C . h (+ D x) (* silu(gate))`."""
    requests, channels = x.shape
    y = torch.empty(requests, channels, dtype=torch.float32, device=x.device)
    if requests == 0:
        return y
    state = A.shape[1]
    typed, base, page_elems = _typed_pool(pool, state_dtype, offset)
    zero = zero.view(torch.int8) if zero.dtype == torch.bool else zero
    state_pad = _pow2(state)
    block_i = max(1, min(_pow2(channels), 4096 // state_pad, 128))
    gate_t = gate if gate is not None else x
    _ssm_step_kernel[(requests, triton.cdiv(channels, block_i))](
        x, dt, A, B, C, D if D is not None else x, gate_t, y, typed, read_pages, write_pages, zero,
        base, page_elems, channels, *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *gate_t.stride(), *y.stride(), *read_pages.stride(), *write_pages.stride(),
        STATE=state, STATE_PAD=state_pad, BLOCK_I=block_i, HAS_D=D is not None, HAS_GATE=gate is not None)
    return y


# -- a layer's elementwise work in one pass ----------------------------------------
@triton.jit
def _norm_scale(y, w_ptr, d, ok, offset, out_ptr, HAS_WEIGHT: tl.constexpr, ROUND_BEFORE_SCALE: tl.constexpr):
    if HAS_WEIGHT:
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32) + offset
        if ROUND_BEFORE_SCALE:  # Llama's `w * norm(x).to(dtype)`
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = y * w
    return y


@triton.jit
def _norm_rotary_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, dim, s_xt, s_xh, s_ot, s_oh, s_ct, s_st,
                        offset, eps, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_BEFORE_SCALE: tl.constexpr,
                        ROTATE: tl.constexpr):
    """One program per (token, head): the RMS norm of the row, scaled by
    (weight + offset), then, with ROTATE, the rotate-half rotation by the
    token's cos and sin. Each channel's rotation partner (d +- dim/2) is
    normalised from its own load, so no value crosses lanes."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < dim
    row = x_ptr + t * s_xt + h * s_xh
    x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = _norm_scale(x * rstd, w_ptr, d, ok, offset, out_ptr, HAS_WEIGHT, ROUND_BEFORE_SCALE)
    if ROTATE:
        half = dim // 2
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(row + partner, mask=ok, other=0.0).to(tl.float32)
        yp = _norm_scale(xp * rstd, w_ptr, partner, ok, offset, out_ptr, HAS_WEIGHT, ROUND_BEFORE_SCALE)
        # torch rotates the norm's output in the model's dtype: round it first
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        yp = yp.to(out_ptr.dtype.element_ty).to(tl.float32)
        cos = tl.load(cos_ptr + t * s_ct + d, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * s_st + d, mask=ok, other=0.0).to(tl.float32)
        y = y * cos + tl.where(d < half, -yp, yp) * sin
    tl.store(out_ptr + t * s_ot + h * s_oh + d, y.to(out_ptr.dtype.element_ty), mask=ok)


def norm_rotary(x: torch.Tensor, weight: torch.Tensor | None, offset: float, eps: float,
                round_before_scale: bool = False, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> torch.Tensor:
    """x `[tokens, dim]` or `[tokens, heads, dim]` (last stride 1): each row
    times rsqrt(mean(x^2) + eps), in float32, times (weight + offset) where
    `weight` is given (after rounding to x's dtype with
    `round_before_scale`), then rotated by cos, sin `[tokens, dim]` where
    given. A new contiguous tensor of x's dtype: what layers/norm.py's
    RMSNorm (and its `rotated`) computes, in one pass instead of five to ten."""
    view = x if x.dim() == 3 else x.reshape(x.shape[0], 1, x.shape[-1])
    tokens, heads, dim = view.shape
    out = torch.empty(view.shape, dtype=x.dtype, device=x.device)
    if tokens and heads:
        rotate = cos is not None
        _norm_rotary_kernel[(tokens, heads)](
            view, weight if weight is not None else view, cos if rotate else view, sin if rotate else view, out,
            dim, view.stride(0), view.stride(1), out.stride(0), out.stride(1),
            cos.stride(0) if rotate else 0, sin.stride(0) if rotate else 0, float(offset), float(eps),
            BLOCK_D=_pow2(dim), HAS_WEIGHT=weight is not None, ROUND_BEFORE_SCALE=round_before_scale,
            ROTATE=rotate)
    return out.view(x.shape)


@triton.jit
def _gated_activation_kernel(in_ptr, out_ptr, inter, s_ir, s_or, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, tile of columns): act(gate) * up, the gate in
    the row's first `inter` columns, up in the next; the activation rounded
    to the output dtype before the product, as torch's two ops do."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < inter
    gate = tl.load(in_ptr + r * s_ir + c, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + r * s_ir + inter + c, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:
        act = gate * tl.sigmoid(gate)
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * s_or + c, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


GATED_ACTIVATIONS = ("silu", "gelu_tanh")


def gated_activation(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """gate_up `[rows, 2 * inter]` (last stride 1; the gate's columns, then
    up's) -> act(gate) * up `[rows, inter]`; `kind` one of GATED_ACTIVATIONS."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, _pow2(inter))
        _gated_activation_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), GELU_TANH=kind == "gelu_tanh", BLOCK=block)
    return out


# -- Mamba-1 prefill: the selective scan of chunks -----------------------------------
@triton.jit
def _selective_scan_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, h0_ptr, len_ptr, y_ptr, h_ptr, channels,
                           s_xr, s_xt, s_xi, s_dr, s_dt, s_di, s_ai, s_an, s_br, s_bt, s_bn, s_cr, s_ct, s_cn,
                           s_h0r, s_h0i, s_h0n, s_yr, s_yt, s_yi, s_hr, s_hi, s_hn,
                           STATE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_I: tl.constexpr):
    """One program per (chunk, tile of channels), its state tile [BLOCK_I,
    STATE] in registers through the chunk's tokens:
    h = exp(dt A) h + dt x B;  y_t = C_t . h."""
    r, i, n, i_ok, n_ok, tile = _state_tile(channels, STATE, STATE_PAD, BLOCK_I)
    A = tl.load(a_ptr + i[:, None] * s_ai + n[None, :] * s_an, mask=tile, other=0.0).to(tl.float32)
    h = tl.load(h0_ptr + r * s_h0r + i[:, None] * s_h0i + n[None, :] * s_h0n, mask=tile, other=0.0).to(tl.float32)
    length = tl.load(len_ptr + r)
    for t in range(0, length):
        x = tl.load(x_ptr + r * s_xr + t * s_xt + i * s_xi, mask=i_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + r * s_dr + t * s_dt + i * s_di, mask=i_ok, other=0.0).to(tl.float32)
        B = tl.load(b_ptr + r * s_br + t * s_bt + n * s_bn, mask=n_ok, other=0.0).to(tl.float32)
        C = tl.load(c_ptr + r * s_cr + t * s_ct + n * s_cn, mask=n_ok, other=0.0).to(tl.float32)
        h = tl.exp(dt[:, None] * A) * h + (dt * x)[:, None] * B[None, :]
        tl.store(y_ptr + r * s_yr + t * s_yt + i * s_yi, tl.sum(h * C[None, :], axis=1), mask=i_ok)
    tl.store(h_ptr + r * s_hr + i[:, None] * s_hi + n[None, :] * s_hn, h, mask=tile)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mamba_ops.selective_scan without per-token states: R chunks side by
    side, x, dt `[R, L, I]` (dt after softplus), A `[I, N]`, B, C `[R, L,
    N]`, state `[R, I, N]`, chunk r's tokens the first lengths[r] (on the
    device). Returns (y `[R, L, I]` float32, 0 past a chunk's length, the
    final states `[R, I, N]` float32). One program per chunk and channel
    tile walks the tokens, where the reference launches a few ops per token."""
    requests, length, channels = x.shape
    y = torch.zeros(requests, length, channels, dtype=torch.float32, device=x.device)
    h = torch.empty(requests, channels, A.shape[1], dtype=torch.float32, device=x.device)
    if requests == 0:
        return y, h
    n = A.shape[1]
    block_i = max(1, min(_pow2(channels), 32))
    _selective_scan_kernel[(requests, triton.cdiv(channels, block_i))](
        x, dt, A, B, C, state, lengths, y, h, channels, *x.stride(), *dt.stride(), *A.stride(), *B.stride(),
        *C.stride(), *state.stride(), *y.stride(), *h.stride(), STATE=n, STATE_PAD=_pow2(n), BLOCK_I=block_i)
    return y, h


# -- Gated DeltaNet: the gated delta rule, token by token ------------------------------
@triton.jit
def _gated_delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, len_ptr, state_ptr, rows_ptr, out_ptr,
                        length, key_heads, value_heads, value_dim, s_state,
                        KEY_DIM: tl.constexpr, KEY_PAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per (request, value head, tile of value channels), the
    state tile [K, BLOCK_V] in registers through the request's tokens:
    S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q. The state
    is read from and written back to its row of the gathered states."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // (value_heads // key_heads)
    kk = tl.arange(0, KEY_PAD)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < KEY_DIM, vv < value_dim
    tile = k_ok[:, None] & v_ok[None, :]
    at_state = state_ptr + tl.load(rows_ptr + r) * s_state + h * KEY_DIM * value_dim
    S = tl.load(at_state + kk[:, None] * value_dim + vv[None, :], mask=tile, other=0.0)
    n = tl.load(len_ptr + r)
    for t in range(0, n):
        at = r * length + t
        q = tl.load(q_ptr + (at * key_heads + kh) * KEY_DIM + kk, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + (at * key_heads + kh) * KEY_DIM + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + (at * value_heads + h) * value_dim + vv, mask=v_ok, other=0.0)
        decay = tl.exp(tl.load(g_ptr + at * value_heads + h))
        beta = tl.load(beta_ptr + at * value_heads + h)
        S = S * decay
        u = beta * (v - tl.sum(S * k[:, None], axis=0))
        S = S + k[:, None] * u[None, :]
        tl.store(out_ptr + (at * value_heads + h) * value_dim + vv, tl.sum(S * q[:, None], axis=0), mask=v_ok)
    tl.store(at_state + kk[:, None] * value_dim + vv[None, :], S, mask=tile)


def gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                lengths: torch.Tensor, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """layers/gated_delta_ops.py's rule token by token for R requests side
    by side, from and back to their float32 states in place: q, k `[R, L,
    Hk, K]`, v `[R, L, Hv, V]`, g, beta `[R, L, Hv]` (float32, contiguous),
    request r's tokens the first lengths[r], its state row `rows[r]` of
    `states` `[*, Hv, K, V]` (each row contiguous). Returns o `[R, L, Hv,
    V]` float32, 0 past a request's length. Sequential: a run cut anywhere
    leaves the states one pass leaves."""
    requests, length, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[-2:]
    out = torch.zeros(requests, length, value_heads, value_dim, dtype=torch.float32, device=v.device)
    if requests == 0 or length == 0:
        return out
    block_v = min(64, _pow2(value_dim))
    _gated_delta_kernel[(requests, value_heads, triton.cdiv(value_dim, block_v))](
        q, k, v, g, beta, lengths, states, rows, out, length, key_heads, value_heads, value_dim, states.stride(0),
        KEY_DIM=key_dim, KEY_PAD=_pow2(key_dim), BLOCK_V=block_v)
    return out


# -- Mamba-2: the SSD state update, token by token -------------------------------------
@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, len_ptr, state_ptr, rows_ptr, y_ptr,
                length, heads, groups, head_dim, s_state,
                STATE: tl.constexpr, STATE_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program per (request, head, tile of head channels), the state
    tile [BLOCK_P, N] in registers through the request's tokens:
    S = exp(dt A) S + dt x B^T; y = S C + D x. The state is read from and
    written back to its row of the gathered states."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (heads // groups)
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, STATE_PAD)
    p_ok, n_ok = pp < head_dim, nn < STATE
    tile = p_ok[:, None] & n_ok[None, :]
    at_state = state_ptr + tl.load(rows_ptr + r) * s_state + h * head_dim * STATE
    S = tl.load(at_state + pp[:, None] * STATE + nn[None, :], mask=tile, other=0.0)
    A = tl.load(a_ptr + h)
    D = tl.load(d_ptr + h)
    n = tl.load(len_ptr + r)
    for t in range(0, n):
        at = r * length + t
        x = tl.load(x_ptr + (at * heads + h) * head_dim + pp, mask=p_ok, other=0.0)
        dt = tl.load(dt_ptr + at * heads + h)
        B = tl.load(b_ptr + (at * groups + g) * STATE + nn, mask=n_ok, other=0.0)
        C = tl.load(c_ptr + (at * groups + g) * STATE + nn, mask=n_ok, other=0.0)
        S = tl.exp(dt * A) * S + (dt * x)[:, None] * B[None, :]
        tl.store(y_ptr + (at * heads + h) * head_dim + pp, tl.sum(S * C[None, :], axis=1) + D * x, mask=p_ok)
    tl.store(at_state + pp[:, None] * STATE + nn[None, :], S, mask=tile)


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
        lengths: torch.Tensor, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """layers/ssd_ops.py's update token by token for R requests side by
    side, from and back to their float32 states in place: x `[R, L, H, P]`,
    dt `[R, L, H]` (after softplus and clamp), A, D `[H]`, B, C `[R, L, G,
    N]` (float32, contiguous), request r's tokens the first lengths[r], its
    state row `rows[r]` of `states` `[*, H, P, N]` (each row contiguous).
    Returns y `[R, L, H, P]` float32, 0 past a request's length."""
    requests, length, heads, head_dim = x.shape
    groups, state = B.shape[-2:]
    y = torch.zeros(requests, length, heads, head_dim, dtype=torch.float32, device=x.device)
    if requests == 0 or length == 0:
        return y
    block_p = min(32, _pow2(head_dim))
    _ssd_kernel[(requests, heads, triton.cdiv(head_dim, block_p))](
        x, dt, A, B, C, D, lengths, states, rows, y, length, heads, groups, head_dim, states.stride(0),
        STATE=state, STATE_PAD=_pow2(state), BLOCK_P=block_p)
    return y
