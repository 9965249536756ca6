"""Paged attention, torch reference: store the new tokens' K/V at their
slots, then attend through the group's block table under the layer type's
rule. Exact and simple on purpose: it is the oracle of the Triton kernels.

A layer's cache is a view `[num_pages, 2, block_size, kv_heads, head_dim]`
(K then V) of the shared pool (engine/kv_buffers.py). A block of a group may
span several pages; the layer reads the column of the block table that holds
its pages (`column`).

`store_kv` and `paged_attention` are what model code calls; on CUDA (or
when forced) they hand over to hybridkv's Triton kernels (layers/backend.py
decides, layers/triton_ops.py computes the same thing without gathering).

Which keys a query at position i reads (DESIGN section 1):
  full            j <= i
  sliding window  i - W < j <= i
  chunked local   j <= i and j // C == i // C
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import backend


def visible(kind: str, window: int, chunk: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Boolean mask of keys each query may read (broadcasting q_pos vs k_pos)."""
    mask = k_pos <= q_pos
    if kind == "sliding_window":
        mask &= k_pos > q_pos - window
    elif kind == "chunked_local":
        mask &= (k_pos // chunk) == (q_pos // chunk)
    return mask


@dataclass
class PrefillSegment:
    """One request with several query tokens in this step."""

    start: int  # first query row in the step's token tensor
    length: int
    pages: torch.Tensor  # [width, blocks] pages to read, per column
    mask: torch.Tensor  # [length, blocks * block_size] keys visible to each query
    query_pos: int = 0  # position of the first query token
    key_pos: int = 0  # position of the first key in pages (a multiple of block_size)


@dataclass
class DecodeGroup:
    """Requests with one query token each, attended in one batched call.
    The runner groups them by length so that little padding is read."""

    rows: torch.Tensor  # [requests] query rows in the step's token tensor
    pages: torch.Tensor  # [width, requests, blocks] pages to read, per column (null page as padding)
    mask: torch.Tensor  # [requests, blocks * block_size] keys visible to each query
    query_pos: torch.Tensor | None = None  # [requests] position of each query
    key_pos: torch.Tensor | None = None  # [requests] position of the first key in pages (block aligned)
    num_blocks: torch.Tensor | None = None  # [requests] blocks of pages actually used (the rest is padding)


@dataclass
class AttentionMetadata:
    """What the attention layers of one KV cache group need for one step
    (built once by the runner, shared by the group's layers)."""

    kind: str
    window: int
    chunk: int
    block_size: int
    store_pages: torch.Tensor  # [width, tokens] page of each new token, per column
    store_offsets: torch.Tensor  # [tokens] slot within the page
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    # The same metadata as kernel arguments, built on first use by a kernel
    # backend and shared by the group's layers (layers/backend.py).
    kernel_inputs: dict = field(default_factory=dict, repr=False)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, column: int) -> None:
    """Write the step's new K/V rows (`[tokens, kv_heads, head_dim]`) at their slots."""
    if backend.use_triton(cache):
        return backend.store_kv(cache, k, v, meta, column)
    pages = meta.store_pages[column]
    cache[pages, 0, meta.store_offsets] = k.to(cache.dtype)
    cache[pages, 1, meta.store_offsets] = v.to(cache.dtype)


def _attend(q, k, v, mask, scale, softcap):
    """q [B, Hq, Lq, D]; k, v [B, Hkv, Lk, D]; mask [B, 1, Lq, Lk] (bool)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _gather(cache: torch.Tensor, pages: torch.Tensor):
    """K and V rows of `pages` ([..., blocks]) as [..., blocks * block_size,
    kv_heads, head_dim] each: one row copy per page (index_select), no more."""
    num_pages, _, bs, heads, dim = cache.shape
    rows = cache.view(num_pages, 2, bs * heads * dim)
    flat = pages.reshape(-1)
    shape = (*pages.shape[:-1], pages.shape[-1] * bs, heads, dim)
    return (rows[:, 0].index_select(0, flat).view(shape), rows[:, 1].index_select(0, flat).view(shape))


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, column: int,
                    scale: float, softcap: float | None = None) -> torch.Tensor:
    """q: [tokens, q_heads, head_dim] -> [tokens, q_heads, head_dim]. The new
    K/V must already be stored (store_kv)."""
    if backend.use_triton(cache):
        return backend.paged_attention(q, cache, meta, column, scale, softcap)
    out = torch.empty_like(q)
    for group in meta.decodes:
        keys, values = _gather(cache, group.pages[column])  # [R, L, H, D]
        query = q[group.rows].unsqueeze(2)  # [R, Hq, 1, D]
        mask = group.mask[:, None, None, :]
        result = _attend(query, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype), mask,
                         scale, softcap)
        out[group.rows] = result.squeeze(2)
    for seg in meta.prefills:
        keys, values = _gather(cache, seg.pages[column])  # [L, H, D]
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        for first, last, lo, hi in _query_tiles(meta, seg):
            query = q[seg.start + first:seg.start + last].transpose(0, 1).unsqueeze(0)
            result = _attend(query, keys[:, :, lo:hi], values[:, :, lo:hi], seg.mask[None, None, first:last, lo:hi],
                             scale, softcap)
            out[seg.start + first:seg.start + last] = result[0].transpose(0, 1)
    return out


def _query_tiles(meta: AttentionMetadata, seg: PrefillSegment):
    """(first, last, lo, hi): query rows [first, last) of the segment and
    the key columns [lo, hi) they can see. A long segment is cut into tiles
    so that each scores only keys it may read (the columns cut off are
    masked for those rows anyway): under a window or chunk, a tile about that
    long reads ~2 of them rather than the whole segment (a 1,000-token prompt
    under a 128-token window: 2.5x less work); under full attention, tiles
    skip the keys after them (the upper triangle)."""
    columns = seg.mask.shape[-1]
    span = meta.window if meta.kind == "sliding_window" else meta.chunk if meta.kind == "chunked_local" else 0
    tile = max(span, 64) if span else 256
    if seg.length <= 2 * tile:
        return [(0, seg.length, 0, columns)]
    tiles = []
    for first in range(0, seg.length, tile):
        last = min(seg.length, first + tile)
        q_first = seg.query_pos + first
        if meta.kind == "sliding_window":
            oldest = q_first - span + 1
        elif meta.kind == "chunked_local":
            oldest = q_first - q_first % span
        else:
            oldest = seg.key_pos
        lo = max(0, oldest - seg.key_pos)
        hi = min(columns, seg.query_pos + last - seg.key_pos)
        tiles.append((first, last, lo, hi))
    return tiles
