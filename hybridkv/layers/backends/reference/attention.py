"""Paged attention, torch reference: store the new tokens' K/V at their
slots, then attend through the group's block table. Exact and simple on
purpose: it is the oracle of every other backend's attention.

A layer's cache is a view `[pages, 2, block_size, kv_heads, head_dim]` (K
then V) of the shared pool (layers/kv_buffers.py). A block of a group may span
several pages; the layer reads the column of the block table that holds its
pages (`column`). Block tables are the worker's persistent ones: `[width,
table rows, max_blocks]`, one row per running sequence, from key position 0.
What every backend shares (where the new K/V goes, each query's first key,
the split into decodes and chunks) comes built in `AttentionStep` (layers/step.py);
this file adds what only the reference needs: tails to zero, the pages each
decode group or prefill chunk gathers, and their masks.

Which keys a query at position i reads is the layer's read rule,
`spec.first_visible(i)` .. i (core/specs.py); nothing here knows a layer type.
Attention sinks (gpt-oss) are one more logit per query head in each
softmax, with no value (`softmax`): they touch no page.

Decode queries are attended together, each reading its own blocks from its
first visible one (`DecodeGroup`): at fixed shapes (a step about to be
captured) one group over a bound that holds for every position; in an eager
step, groups of similar lengths that read little padding. Each prefill
chunk attends on its own, a long one in query tiles that score only the
keys they may see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...kv_quant import QuantizedCache, dequantize, quantize, rotated, rotation
from ...linear import product_nt
from ...step import AttentionStep

# Decode queries attended together: bigger groups mean fewer calls, smaller
# ones less padding read when lengths differ. Split a group in two (at most
# DECODE_GROUP queries apart) only where it would read over PADDING_LIMIT
# times the blocks its queries need.
DECODE_GROUP = 16
PADDING_LIMIT = 1.25


def decode_groups(lengths: np.ndarray) -> list[np.ndarray]:
    """Indices of `lengths` (blocks each query reads), shortest first, in
    groups that read little padding."""
    order = np.argsort(lengths, kind="stable")
    groups, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order):
            groups.append(order[start:end])
            break
        size = end + 1 - start
        padded = size * lengths[order[end]]
        if size > DECODE_GROUP and padded > PADDING_LIMIT * lengths[order[start:end + 1]].sum():
            groups.append(order[start:end])
            start = end
    return groups


def read_bound(spec, block_size: int, max_blocks: int) -> int:
    """Blocks one query reads at most, wherever it is: ceil((span - 1) /
    block_size) + 1 for a bounded span, every block otherwise."""
    span = spec.span
    return max_blocks if span is None else min(max_blocks, -(-(span - 1) // block_size) + 1)


@dataclass
class DecodeGroup:
    """Queries with one token each, attended in one batched call."""

    rows: torch.Tensor  # [R] query rows in the step's token tensor
    pages: torch.Tensor  # [width, R, blocks] pages to read, from each query's first visible block
    mask: torch.Tensor  # [R, blocks * block_size] keys visible to each query


@dataclass
class PrefillSegment:
    """One sequence with several query tokens in this step."""

    start: int  # first query row in the step's token tensor
    length: int
    pages: torch.Tensor  # [width, blocks] pages to read, per column
    mask: torch.Tensor  # [length, blocks * block_size] keys visible to each query
    query_pos: int  # position of the first query token
    key_pos: int  # position of the first key in pages (a multiple of block_size)


@dataclass
class AttentionMetadata:
    """One KV cache group's step, as the reference ops read it."""

    spec: object
    store_pages: torch.Tensor  # [width, tokens] page of each new token, per column
    store_offsets: torch.Tensor  # [tokens] slot within the page
    tail_pages: torch.Tensor | None  # [width, sequences, block_size - 1] last blocks first written now, per column
    tail_slots: torch.Tensor | None  # [sequences, block_size - 1] the slots after the last new token (clamped)
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)


def _decode_group(step: AttentionStep, tokens: torch.Tensor, table_rows: torch.Tensor, blocks: int) -> DecodeGroup:
    """Query rows `tokens` of the sequences in table rows `table_rows`
    (device), each reading `blocks` blocks from its first visible one.
    Device ops only: capturable."""
    bs, table = step.block_size, step.table
    q_pos = step.inputs.positions[tokens]
    first = step.first_key[tokens]
    cols = (first // bs)[:, None] + torch.arange(blocks, device=q_pos.device)[None, :]  # [R, blocks]
    # Columns past the table (a query near the end of the context) read its
    # last block again; their key positions lie past the query: masked.
    # Blocks past the query's own are the null page: a table row may hold
    # stale ids there (pages since given to anything), never to be read.
    pages = table[:, table_rows[:, None], cols.clamp(max=table.shape[2] - 1)]
    pages = torch.where(cols <= (q_pos // bs)[:, None], pages, 0)
    key_pos = (cols[:, :, None] * bs + torch.arange(bs, device=q_pos.device)).reshape(len(tokens), blocks * bs)
    mask = (key_pos >= first[:, None]) & (key_pos <= q_pos[:, None])
    return DecodeGroup(tokens, pages, mask)


def decode_group_list(step: AttentionStep) -> list[DecodeGroup]:
    """The decodes in one group over the bound every position keeps at
    fixed shapes; eagerly, in groups of similar lengths (`decode_groups`)."""
    decodes, host, bs = step.inputs.decodes, step.inputs.host, step.block_size
    if decodes is None:
        return []
    if step.inputs.fixed_shape:
        bound = read_bound(step.spec, bs, step.table.shape[2])
        return [_decode_group(step, decodes.tokens, decodes.table_rows, bound)]
    q = host.positions[host.starts[host.decodes]]
    needed = q // bs - step.spec.first_visible(q) // bs + 1
    groups = []
    for part in decode_groups(needed):
        index = torch.from_numpy(part).to(decodes.tokens.device)
        groups.append(_decode_group(step, decodes.tokens[index], decodes.table_rows[index], int(needed[part].max())))
    return groups


def prefill_segments(step: AttentionStep) -> list[PrefillSegment]:
    host, spec, bs = step.inputs.host, step.spec, step.block_size
    if step.inputs.chunks is None:
        return []
    device = step.first_key.device
    segments = []
    for i in host.chunks:
        start, count = int(host.starts[i]), int(host.counts[i])
        q0 = int(host.positions[start])
        lo, hi = spec.first_visible(q0) // bs, (q0 + count - 1) // bs
        pages = step.table[:, int(host.table_rows[i]), lo:hi + 1]
        q_pos = torch.arange(q0, q0 + count, device=device)[:, None]
        k_pos = torch.arange(lo * bs, (hi + 1) * bs, device=device)[None, :]
        mask = (k_pos >= spec.first_visible(q_pos)) & (k_pos <= q_pos)
        segments.append(PrefillSegment(start, count, pages, mask, q0, lo * bs))
    return segments


def tails(step: AttentionStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pages, slots) of the slots after each sequence's last new token in
    its block, to zero: in a fixed-shape step every sequence's
    (unconditionally, no data-dependent shape); in an eager one only those
    of blocks this step writes first (a block's tail, once zeroed, stays so
    until the block is written)."""
    inputs, bs = step.inputs, step.block_size
    device = inputs.positions.device
    if inputs.fixed_shape:
        last = inputs.decodes.tokens
    else:
        host = inputs.host
        ends = host.starts + host.counts - 1
        fresh = np.nonzero(host.positions[ends] // bs * bs >= host.positions[host.starts])[0]
        if not fresh.size:
            return None, None
        last = torch.from_numpy(ends[fresh]).to(device)
    tail = (inputs.positions[last] % bs)[:, None] + torch.arange(1, bs, device=device)
    return step.store_pages[:, last, None].expand(-1, -1, bs - 1), tail.clamp(max=bs - 1)


def build(step: AttentionStep) -> AttentionMetadata:
    """The group's metadata for one step, from what every backend shares."""
    return AttentionMetadata(step.spec, step.store_pages, step.store_offsets, *tails(step), decode_group_list(step),
                             prefill_segments(step))


def store(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, column: int) -> None:
    """Write the step's new K/V rows (`[tokens, kv_heads, head_dim]`) at their slots.

    First the slots after a sequence's last new token in its block are
    zeroed, when this step writes the block first: a query's reads are
    masked there, but masked keys must hold finite values (both a masked
    score, NaN + -inf, and a zero weight times a NaN value are NaN), and an
    unwritten slot may still hold bytes another layer type left in the page.
    (Clamped entries past the block's end hit its last slot, which is either
    a tail slot or this step's own last token, stored right after.)"""
    if isinstance(cache, QuantizedCache):  # codes and scales, each stored as the pages hold them
        h = rotation(cache.dtype, k.shape[-1], k.device)
        if h is not None:  # int8 rows are stored rotated (kv_quant.py)
            k, v = k.float() @ h, v.float() @ h
        (k, k_scales), (v, v_scales) = quantize(k, cache.dtype), quantize(v, cache.dtype)
        store(cache.scales.unsqueeze(-1), k_scales.unsqueeze(-1), v_scales.unsqueeze(-1), meta,
              cache.scales_at(column))
        cache = cache.codes
    if meta.tail_pages is not None:
        # A device zero, not the literal: a Python scalar becomes a CPU tensor
        # that index_put_ copies, which a CUDA graph capture refuses.
        cache[meta.tail_pages[column], :, meta.tail_slots] = cache.new_zeros(())
    pages = meta.store_pages[column]
    cache[pages, 0, meta.store_offsets] = k.to(cache.dtype)
    cache[pages, 1, meta.store_offsets] = v.to(cache.dtype)


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dimension of `scores` (masked entries
    -inf). With `sinks` (broadcast to scores' shape but its last
    dimension, which is 1): each row's sink is one more logit, in the
    denominator only (a key with no value), dropped from the weights."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1]


def _attend(q, k, v, mask, scale, softcap, sinks=None):
    """q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D]; mask [B, 1, Lq, Lk] (bool);
    sinks [Hq] or None. Masked keys hold finite values (see `store`)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax(scores, None if sinks is None else sinks.view(1, -1, 1, 1)).to(q.dtype)
    return torch.matmul(probs, v)


def attend_decodes(q, k, v, mask, scale, softcap, sinks=None):
    """One query per sequence: q [R, Hq, D]; k, v [R, L, H, D]; mask [R, L].
    Two batched matmuls with each KV head's queries side by side, rather
    than SDPA (whose CPU flash attention tiles a query length of 1): as fast
    at batch 1 and 16 on the real Gemma-3 270M, 3% faster a step at batch 64
    (benchmarks/cpu_decode_step.py), and the soft-capped case needs no
    repeated K/V. sinks: [Hq] or None (`softmax`)."""
    rows, heads, dim = k.shape[0], k.shape[2], k.shape[3]
    groups = q.shape[1] // heads
    query = q.view(rows, heads, groups, dim)  # [R, H, G, D]
    scores = torch.matmul(query, k.permute(0, 2, 3, 1)).mul_(scale)  # [R, H, G, L]
    if softcap is not None:
        scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = softmax(scores, None if sinks is None else sinks.view(1, heads, groups, 1)).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).view(rows, q.shape[1], dim)  # [R, H, G, D] -> [R, Hq, D]


def gather(cache: torch.Tensor | QuantizedCache, pages: torch.Tensor, column: int):
    """K and V rows of `pages[column]` (`pages` [width, ..., blocks], per
    page column) as [..., blocks * block_size, kv_heads, head_dim] each: one
    row copy per page (index_select), no more (a quantized layer's: its
    codes and scales, the scales through their own column where they lie
    apart, gathered, then widened to float32)."""
    if isinstance(cache, QuantizedCache):
        k, v = gather(cache.codes, pages, column)
        k_scales, v_scales = gather(cache.scales.unsqueeze(-1), pages, cache.scales_at(column))
        return (dequantize(k, k_scales.squeeze(-1), torch.float32),
                dequantize(v, v_scales.squeeze(-1), torch.float32))
    num_pages, _, bs, heads, dim = cache.shape
    rows = cache.view(num_pages, 2, bs * heads * dim)
    pages = pages[column]
    flat = pages.reshape(-1)
    shape = (*pages.shape[:-1], pages.shape[-1] * bs, heads, dim)
    return (rows[:, 0].index_select(0, flat).view(shape), rows[:, 1].index_select(0, flat).view(shape))


def _attend_products(q, k, v, mask, scale, softcap, sinks=None, weights=None):
    """q [Lq, Hq, D]; k, v [Lk, Hkv, D]; mask [Lq, Lk] (bool); sinks [Hq]
    or None -> [Lq, Hq, D]. `weights`: a backend's
    `weights(scores, mask, scale, softcap, sinks)` -> the softmax's weights in
    the scores' dtype (the CPU backend's one pass: attention.py), or None
    for torch's passes.
    Each KV head's queries stacked as the rows of one product (scores [Lq *
    G, Lk]), a softmax, a second product: on the CPU both products go
    through oneDNN (linear.product_nt), which makes a prefill tile 1.7x
    faster than torch's CPU flash attention, whose products are MKL's
    (benchmarks/prefill_tiles.py)."""
    rows, heads, dim = q.shape
    groups = heads // k.shape[1]
    padded = -(-rows // ROW_BUCKET) * ROW_BUCKET  # few distinct shapes (linear.product_nt)
    if padded != rows:
        q = torch.cat([q, q.new_zeros(padded - rows, heads, dim)])
        mask = torch.cat([mask, mask.new_ones(padded - rows, mask.shape[1])])
    hidden = ~mask[:, None, :] if weights is None else None
    out = torch.empty_like(q)
    for h in range(k.shape[1]):
        query = q[:, h * groups:(h + 1) * groups].reshape(padded * groups, dim)
        # One KV head's rows made dense (a copy where there are several
        # heads): the products run on dense operands (linear.product_nt).
        keys, values = k[:, h].contiguous(), v[:, h].contiguous()
        scores = product_nt(query, keys).view(padded, groups, -1)
        if weights is not None:
            probs = weights(scores, mask, scale, softcap, None if sinks is None else sinks[h * groups:(h + 1) * groups])
            out[:, h * groups:(h + 1) * groups] = product_nt(probs.view(padded * groups, -1), values.t()).view(
                padded, groups, dim)
            continue
        scores.mul_(scale)
        if softcap is not None:
            scores = torch.tanh(scores.div_(softcap)).mul_(softcap)
        scores.masked_fill_(hidden, float("-inf"))
        sink = None if sinks is None else sinks[h * groups:(h + 1) * groups].view(1, groups, 1)
        probs = softmax(scores, sink).to(q.dtype)
        out[:, h * groups:(h + 1) * groups] = product_nt(probs.view(padded * groups, -1), values.t()).view(
            padded, groups, dim)
    return out[:rows]


def attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, column: int,
           scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, q_heads, head_dim] -> [tokens, q_heads, head_dim]. The new
    K/V must already be stored. Prefill tiles run as two products on the CPU
    (`_attend_products`), through SDPA elsewhere (flash attention on CUDA;
    the explicit products where a soft-cap or sinks change the softmax).
    Over rotated pages (kv_quant.py) the queries are rotated alike and the
    output rotated back."""
    if isinstance(cache, QuantizedCache) and cache.rotation is not None:
        h = cache.rotation
        return rotated(attend(rotated(q, h), cache.unrotated(), meta, column, scale, softcap, sinks), h)
    out = torch.empty_like(q)
    for group in meta.decodes:
        keys, values = gather(cache, group.pages, column)  # [R, L, H, D]
        out[group.rows] = attend_decodes(q[group.rows], keys.to(q.dtype), values.to(q.dtype), group.mask, scale,
                                          softcap, sinks)
    attend_prefills(q, cache, meta.spec, meta.prefills, column, scale, softcap, out, sinks)
    return out


def attend_prefills(q: torch.Tensor, cache: torch.Tensor, spec, prefills: list[PrefillSegment], column: int,
                    scale: float, softcap: float | None, out: torch.Tensor, sinks: torch.Tensor | None = None,
                    weights=None) -> None:
    """The prefill chunks' part of `attend`, into `out`; `weights`: as
    `_attend_products` takes it (CPU tiles only)."""
    for seg in prefills:
        keys, values = gather(cache, seg.pages, column)  # [L, H, D]
        keys, values, mask = keys.to(q.dtype), values.to(q.dtype), seg.mask
        if q.device.type == "cpu":  # key ranges padded to few distinct lengths (linear.product_nt)
            columns = -(-keys.shape[0] // KEY_BUCKET) * KEY_BUCKET
            if columns != keys.shape[0]:
                pad = columns - keys.shape[0]
                keys = torch.cat([keys, keys.new_zeros(pad, *keys.shape[1:])])
                values = torch.cat([values, values.new_zeros(pad, *values.shape[1:])])
                mask = torch.cat([mask, mask.new_zeros(mask.shape[0], pad)], dim=1)
        for first, last, lo, hi in query_tiles(spec, seg):
            rows = slice(seg.start + first, seg.start + last)
            if q.device.type == "cpu":
                width = -(-(hi - lo) // KEY_BUCKET) * KEY_BUCKET
                lo = min(lo, columns - width)  # widened to the bucket: the keys added are masked
                out[rows] = _attend_products(q[rows], keys[lo:lo + width], values[lo:lo + width],
                                             mask[first:last, lo:lo + width], scale, softcap, sinks, weights)
                continue
            query = q[rows].transpose(0, 1).unsqueeze(0)
            result = _attend(query, keys[lo:hi].transpose(0, 1).unsqueeze(0),
                             values[lo:hi].transpose(0, 1).unsqueeze(0), seg.mask[None, None, first:last, lo:hi],
                             scale, softcap, sinks)
            out[rows] = result[0].transpose(0, 1)


# On the CPU a tile's products go to oneDNN, which builds code for each new
# shape: query rows are padded to a multiple of ROW_BUCKET and key ranges
# widened to a multiple of KEY_BUCKET (the added keys masked), so that a
# server sees a few hundred shapes rather than one per prompt length.
ROW_BUCKET = 16
KEY_BUCKET = 128

# Queries per prefill tile. A tile scores every key it is given, masked or
# not (SDPA and the CPU's products alike), so its waste is the part of its
# key range it may not see: ~half a tile under the causal diagonal, plus
# what lies below a window's lower edge; a smaller tile wastes less but
# runs smaller products, each with its call's cost. 128 against 64, the
# real Gemma-3 270M's prefill attention, the two taking turns layer by
# layer in one engine: 0.80x the time in bfloat16 and 0.92x in float32 for
# 16 prompts of 700 tokens, 0.79x in bfloat16 for 32 of 300 (Xeon with
# AMX); whole bfloat16 prefills 2-3% shorter on an AMD EPYC.
# benchmarks/prefill_tiles.py measures tiles against one masked call per
# chunk.
QUERY_TILE = 128


def query_tiles(spec, seg: PrefillSegment):
    """(first, last, lo, hi): query rows [first, last) of the segment and
    the key columns [lo, hi) they can see: keys from the tile's first query's
    first visible one to its last query (the columns cut off are masked for
    those rows anyway). A segment of up to two tiles is one call."""
    columns = seg.mask.shape[-1]
    if seg.length <= 2 * QUERY_TILE:
        return [(0, seg.length, 0, columns)]
    tiles = []
    for first in range(0, seg.length, QUERY_TILE):
        last = min(seg.length, first + QUERY_TILE)
        lo = max(0, spec.first_visible(seg.query_pos + first) - seg.key_pos)
        hi = min(columns, seg.query_pos + last - seg.key_pos)
        tiles.append((first, last, lo, hi))
    return tiles
