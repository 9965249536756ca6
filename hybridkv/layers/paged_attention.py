"""Paged attention, torch reference: store the new tokens' K/V at their
slots, then attend through the group's block table under the layer type's
rule. Exact and simple on purpose: it is the oracle of the Triton kernels.

A layer's cache is a view `[num_pages, 2, block_size, kv_heads, head_dim]`
(K then V) of the shared pool (engine/kv_buffers.py). A block of a group may
span several pages; the layer reads the column of the block table that holds
its pages (`column`).

Which keys a query at position i reads (DESIGN section 1):
  full            j <= i
  sliding window  i - W < j <= i
  chunked local   j <= i and j // C == i // C
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


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
    decode_rows: torch.Tensor | None = None  # [decodes] query rows with one query token
    decode_pages: torch.Tensor | None = None  # [width, decodes, blocks]
    decode_mask: torch.Tensor | None = None  # [decodes, blocks * block_size]
    prefills: list[PrefillSegment] = field(default_factory=list)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, column: int) -> None:
    """Write the step's new K/V rows (`[tokens, kv_heads, head_dim]`) at their slots."""
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


def paged_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, column: int,
                    scale: float, softcap: float | None = None) -> torch.Tensor:
    """q: [tokens, q_heads, head_dim] -> [tokens, q_heads, head_dim]. The new
    K/V must already be stored (store_kv)."""
    out = torch.empty_like(q)
    bs = meta.block_size
    if meta.decode_rows is not None and meta.decode_rows.numel():
        pages = meta.decode_pages[column]  # [R, nb]
        kv = cache[pages]  # [R, nb, 2, bs, H, D]
        r, nb = pages.shape
        keys = kv[:, :, 0].reshape(r, nb * bs, *kv.shape[-2:]).transpose(1, 2)
        values = kv[:, :, 1].reshape(r, nb * bs, *kv.shape[-2:]).transpose(1, 2)
        query = q[meta.decode_rows].unsqueeze(2)  # [R, Hq, 1, D]
        mask = meta.decode_mask[:, None, None, :]
        out[meta.decode_rows] = _attend(query, keys.to(q.dtype), values.to(q.dtype), mask, scale,
                                        softcap).squeeze(2)
    for seg in meta.prefills:
        pages = seg.pages[column]
        kv = cache[pages]  # [nb, 2, bs, H, D]
        nb = pages.shape[0]
        keys = kv[:, 0].reshape(nb * bs, *kv.shape[-2:]).transpose(0, 1).unsqueeze(0)
        values = kv[:, 1].reshape(nb * bs, *kv.shape[-2:]).transpose(0, 1).unsqueeze(0)
        query = q[seg.start:seg.start + seg.length].transpose(0, 1).unsqueeze(0)
        result = _attend(query, keys.to(q.dtype), values.to(q.dtype), seg.mask[None, None], scale, softcap)
        out[seg.start:seg.start + seg.length] = result[0].transpose(0, 1)
    return out
