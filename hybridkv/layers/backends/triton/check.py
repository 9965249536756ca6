"""A quick self-test of the Triton kernels on the device they are about to
run on, against dense torch computations written straight from the rules.

`backends.triton.verified` runs it once per device before "auto" hands any real
work to the kernels: if a kernel disagrees (a compiler or driver quirk the
CPU interpreter cannot show), the engine warns and keeps the torch
reference, rather than serving wrong tokens. It takes a few small launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....core.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec
from ...kv_quant import QuantizedCache, dequantize, quantize
from ...mamba_ops import causal_conv_step, selective_scan_step

_CODES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

_TOLERANCE = 2e-3  # float32 inputs; the kernels' dots may run in tf32


def _dense_attention(q, cache, table, q_positions, spec, scale, sinks=None):
    """q [queries, heads, dim] at `q_positions`, keys = every slot of the
    pages in `table` (positions from 0), under the layer's read rule; a
    head's sink is one more logit in its softmax, with no value."""
    kv_heads = cache.shape[3]
    keys = cache[table, 0].reshape(-1, kv_heads, cache.shape[-1])
    values = cache[table, 1].reshape(-1, kv_heads, cache.shape[-1])
    k_pos = torch.arange(keys.shape[0], device=q.device)[None, :]
    mask = (k_pos >= spec.first_visible(q_positions[:, None])) & (k_pos <= q_positions[:, None])
    groups = q.shape[1] // kv_heads
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.cat([scores, sink], -1).softmax(-1)[..., :-1], values.float())
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float())


def _check_attention(ops, device) -> None:
    gen = torch.Generator().manual_seed(0)
    pages, bs, kv_heads, groups, dim = 24, 16, 2, 2, 64
    cache = torch.randn(pages, 2, bs, kv_heads, dim, generator=gen).to(device)
    lengths = [5, 37, 70]
    blocks = [-(-n // bs) for n in lengths]
    order = torch.randperm(pages - 1, generator=gen) + 1
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int64)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = order[used:used + nb]
        used += nb
    table = table.to(device)
    q = torch.randn(len(lengths), kv_heads * groups, dim, generator=gen).to(device)
    scale = dim ** -0.5
    positions = torch.tensor([n - 1 for n in lengths], device=device)
    rows = torch.arange(len(lengths), device=device)
    sinks = (torch.randn(kv_heads * groups, generator=gen) * 3).to(device)  # gpt-oss's sinks, on its window layers
    for spec, sink in ((FullAttentionSpec(kv_heads, dim), None),
                       (SlidingWindowSpec(kv_heads, dim, sliding_window=20), sinks),
                       (ChunkedLocalSpec(kv_heads, dim, chunk_size=32), None)):
        out = torch.empty_like(q)
        ops.paged_decode_attention(out, q, cache, rows, table, rows, positions, spec.first_visible(positions),
                                   scale=scale, sinks=sink)
        for r, nb in enumerate(blocks):
            ref = _dense_attention(q[r:r + 1], cache, table[r, :nb], positions[r:r + 1], spec, scale, sink)
            error = (out[r].float() - ref[0]).abs().max().item()
            if not error < _TOLERANCE:
                raise AssertionError(f"decode attention ({spec.kind}) differs by {error}")
        # A prefill chunk: queries 50..69 of the longest request.
        count, first = 20, lengths[2] - 20
        queries = torch.randn(count, kv_heads * groups, dim, generator=gen).to(device)
        out = torch.empty_like(queries)
        ints = lambda *v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        q_pos = torch.arange(first, first + count, device=device)
        ops.paged_prefill_attention(out, queries, cache, ints(0), ints(count), table, ints(2), q_pos,
                                    spec.first_visible(q_pos), max_length=count, scale=scale, sinks=sink)
        ref = _dense_attention(queries, cache, table[2, :blocks[2]], q_pos, spec, scale, sink)
        error = (out.float() - ref).abs().max().item()
        if not error < _TOLERANCE:
            raise AssertionError(f"prefill attention ({spec.kind}) differs by {error}")
        # Quantized pages: codes and a scale per token and head, against the values they stand for.
        for dtype in _CODES:
            codes, scales = quantize(cache, dtype)
            values = dequantize(codes, scales, torch.float32)
            out = torch.empty_like(q)
            ops.paged_decode_attention(out, q, QuantizedCache(codes, scales), rows, table, rows, positions,
                                       spec.first_visible(positions), scale=scale, sinks=sink)
            ref = torch.cat([_dense_attention(q[r:r + 1], values, table[r, :nb], positions[r:r + 1], spec, scale,
                                              sink) for r, nb in enumerate(blocks)])
            error = (out.float() - ref).abs().max().item()
            if not error < _TOLERANCE:
                raise AssertionError(f"decode attention ({spec.kind}, {dtype} pages) differs by {error}")
        _check_scales_apart(ops, q, quantize(cache, torch.int8), table, rows, positions, spec, scale, sink)


def _check_scales_apart(ops, q, pool, table, rows, positions, spec, scale, sink) -> None:
    """Scales in pages of their own (core/layout.py `scales_apart`): moved
    to other pages, read through a second plane of the table, decode and
    prefill attention give what they give beside the codes, bit for bit."""
    codes, scales = pool
    moved = torch.roll(torch.arange(scales.shape[0], device=scales.device), 5)  # page p's scales on page moved[p]
    apart = torch.zeros_like(scales)
    apart[moved] = scales
    planes = torch.stack([table, moved[table]])
    for where in ("decode", "prefill"):
        out, got = torch.empty_like(q), torch.empty_like(q)
        for cache, tables, scale_tables, into in ((QuantizedCache(codes, scales), table, None, out),
                                                  (QuantizedCache(codes, apart), planes[0], planes[1], got)):
            if where == "decode":
                ops.paged_decode_attention(into, q, cache, rows, tables, rows, positions,
                                           spec.first_visible(positions), scale=scale, sinks=sink,
                                           scale_tables=scale_tables)
            else:  # each request's last query as a segment of one
                ones = torch.ones_like(rows)
                ops.paged_prefill_attention(into, q, cache, rows, ones, tables, rows, positions,
                                            spec.first_visible(positions), max_length=1, scale=scale, sinks=sink,
                                            scale_tables=scale_tables)
        if not torch.equal(out, got):
            raise AssertionError(f"{where} attention ({spec.kind}) reads scales apart from their codes wrongly")


def _check_store(ops, device) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(8, 2, 16, 2, 32, device=device)
    k = torch.randn(5, 2, 32, generator=gen).to(device)
    v = torch.randn(5, 2, 32, generator=gen).to(device)
    slots = torch.tensor([17, 18, -1, 100, 33], device=device)
    ops.store_kv(cache, k, v, slots)
    expected = torch.zeros_like(cache)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // 16, 0, slot % 16] = k[i]
            expected[slot // 16, 1, slot % 16] = v[i]
    if not torch.equal(cache, expected):
        raise AssertionError("store_kv wrote the wrong slots")
    for dtype in _CODES:  # the codes and scales kv_quant.quantize gives, bit for bit
        codes = torch.zeros(8, 2, 16, 2, 32, dtype=dtype, device=device)
        scales = torch.zeros(8, 2, 16, 2, device=device)
        ops.store_codes(codes, scales, k * 3, v, slots)
        for i, slot in enumerate(slots.tolist()):
            for half, rows in ((0, k[i] * 3), (1, v[i])):
                want_codes, want_scales = quantize(rows, dtype)
                page, at = (slot // 16, slot % 16) if slot >= 0 else (0, 0)
                if slot >= 0 and not (torch.equal(codes[page, half, at].view(torch.uint8), want_codes.view(torch.uint8))
                                      and torch.equal(scales[page, half, at], want_scales)):
                    raise AssertionError(f"store_codes ({dtype}) differs from kv_quant's codes")
    # scales in pages of their own (core/layout.py `scales_apart`): the same codes, the scales on those pages
    codes, scales = torch.zeros(8, 2, 16, 2, 32, dtype=torch.int8, device=device), torch.zeros(8, 2, 16, 2,
                                                                                              device=device)
    apart_codes, apart = torch.zeros_like(codes), torch.zeros_like(scales)
    ops.store_codes(codes, scales, k, v, slots)
    ops.store_codes(apart_codes, apart, k, v, slots, torch.where(slots >= 0, (slots + 48) % 128, slots))
    if not (torch.equal(codes, apart_codes) and torch.equal(torch.roll(scales, 3, 0), apart)):
        raise AssertionError("store_codes writes scales apart from their codes to the wrong slots")


def _check_mamba(ops, device) -> None:
    gen = torch.Generator().manual_seed(2)
    channels, width, state, page, pages_per_state = 12, 4, 8, 64, 10
    conv_offset, ssm_offset = 48, 208  # both straddle page boundaries
    pool = torch.zeros(1 + 4 * pages_per_state, page, dtype=torch.uint8, device=device)
    ids = (torch.randperm(4 * pages_per_state, generator=gen) + 1).view(4, pages_per_state).to(device)
    # Row 0 updates in place, row 1 moves to other pages, row 2 starts from zeros.
    read = torch.stack([ids[0], ids[1], torch.zeros_like(ids[0])])
    write = torch.stack([ids[0], ids[2], ids[3]])
    zero = torch.tensor([False, False, True], device=device)

    def views(flat):
        conv = flat[:, conv_offset:conv_offset + channels * (width - 1) * 4].view(torch.float32)
        ssm = flat[:, ssm_offset:ssm_offset + channels * state * 4].view(torch.float32)
        return conv.view(-1, channels, width - 1), ssm.view(-1, channels, state)

    flat = pool[read].reshape(3, -1)
    conv0, ssm0 = views(flat)
    conv0.copy_(torch.randn(conv0.shape, generator=gen))
    ssm0.copy_(torch.randn(ssm0.shape, generator=gen))
    flat[2] = 0
    for r in (0, 1):
        pool[read[r]] = flat[r].view(pages_per_state, page)
    conv0, ssm0 = (t.clone() for t in views(flat))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x, weight, bias = randn(3, channels), randn(channels, width), randn(channels)
    dt, A = F.softplus(randn(3, channels)), -torch.exp(randn(channels, state))
    B, C, D, gate = randn(3, state), randn(3, state), randn(channels), randn(3, channels)
    ref_x, ref_conv = causal_conv_step(x, conv0, weight, bias)
    ref_x = F.silu(ref_x)
    ref_y, ref_ssm = selective_scan_step(ref_x, dt, A, B, C, ssm0)
    ref_y = (ref_y + ref_x * D) * F.silu(gate)
    got_x = ops.mamba_conv_step(pool, read, write, zero, conv_offset, torch.float32, x, weight, bias, silu=True)
    got_y = ops.mamba_ssm_step(pool, read, write, zero, ssm_offset, torch.float32, got_x, dt, A, B, C, D, gate)
    conv1, ssm1 = views(pool[write].reshape(3, -1))
    for name, got, ref in (("conv output", got_x, ref_x), ("ssm output", got_y, ref_y),
                           ("conv state", conv1, ref_conv), ("ssm state", ssm1, ref_ssm)):
        error = (got.float() - ref.float()).abs().max().item()
        if not error < _TOLERANCE:
            raise AssertionError(f"Mamba step {name} differs by {error}")


def check(ops, device: torch.device) -> None:
    """Raise AssertionError naming the first kernel that disagrees."""
    with torch.inference_mode():
        _check_store(ops, device)
        _check_attention(ops, device)
        _check_mamba(ops, device)
