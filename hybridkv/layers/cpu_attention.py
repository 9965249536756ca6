"""Attention on the CPU through hybridkv's C kernel (cpu_kernels.c): the
decode queries of an eager step read their keys where they lie in the
pool, each its own range, in one call per layer; stores, prefill chunks and
fixed-shape steps (the ones torch.compile traces) stay the torch
reference's (paged_attention.py), whose metadata this extends.

Why: the reference gathers every page a decode group reads (index_select),
then reads the copy again in two batched products. On the real Gemma-3
270M at batch 16 and ~700 tokens of context that was a third of a decode
step (benchmarks/cpu_decode_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from . import paged_attention
from .step import AttentionStep


@dataclass
class NativeDecodes:
    """The step's decode queries as the kernel reads them."""

    rows: torch.Tensor  # [R] query rows in the step's token tensor
    pages: torch.Tensor  # [width, R, blocks] int64: each row's pages from the block of its first key
    first: torch.Tensor  # [R] int64: first key position each row reads
    last: torch.Tensor  # [R] int64: its own position, the last key it reads


@dataclass
class NativeMetadata:
    reference: paged_attention.AttentionMetadata  # stores and prefill chunks (its `decodes` left empty)
    decodes: NativeDecodes | None
    step: AttentionStep  # for the reference's decode groups, where the kernel cannot read a pool

    @cached_property
    def reference_decodes(self) -> list[paged_attention.DecodeGroup]:
        """Built on first need, once for all the group's layers."""
        return paged_attention._decode_groups(self.step)


def decodes(step: AttentionStep) -> NativeDecodes | None:
    inputs, bs = step.inputs, step.block_size
    if inputs.decodes is None:
        return None
    host = inputs.host
    last = host.positions[host.starts[host.decodes]]
    first = np.asarray(step.spec.first_visible(last), dtype=np.int64)
    blocks = int((last // bs - first // bs).max()) + 1
    # Columns past a row's last block are clamped into the table; the kernel
    # never reads them.
    cols = np.minimum((first // bs)[:, None] + np.arange(blocks), step.table.shape[2] - 1)
    pages = step.table[:, inputs.decodes.table_rows[:, None], torch.from_numpy(cols)].to(torch.int64).contiguous()
    return NativeDecodes(inputs.decodes.tokens, pages, torch.from_numpy(first), torch.from_numpy(last))


class NativeAttention:
    """The `attention` side of the "cpu" backend (backend.py)."""

    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def build(step: AttentionStep):
        if step.inputs.fixed_shape:
            return paged_attention.build(step)
        reference = paged_attention.AttentionMetadata(step.spec, step.store_pages, step.store_offsets,
                                                      *paged_attention._tails(step), [],
                                                      paged_attention._prefill_segments(step))
        return NativeMetadata(reference, decodes(step), step)

    @staticmethod
    def store(cache, k, v, meta, column):
        paged_attention.store(cache, k, v, meta.reference if isinstance(meta, NativeMetadata) else meta, column)

    def attend(self, q, cache, meta, column, scale, softcap=None):
        if not isinstance(meta, NativeMetadata):
            return paged_attention.attend(q, cache, meta, column, scale, softcap)
        out = torch.empty_like(q)
        if meta.decodes is not None and not self.supports(q, cache):
            for group in meta.reference_decodes:
                keys, values = paged_attention._gather(cache, group.pages[column])
                out[group.rows] = paged_attention._attend_decodes(q[group.rows], keys.to(q.dtype), values.to(q.dtype),
                                                                  group.mask, scale, softcap)
        elif meta.decodes is not None:
            out[meta.decodes.rows] = self.attend_decodes(q[meta.decodes.rows], cache, meta.decodes, column, scale,
                                                         softcap)
        ref = meta.reference
        paged_attention.attend_prefills(q, cache, ref.spec, ref.prefills, column, scale, softcap, out)
        return out

    def attend_decodes(self, q: torch.Tensor, cache: torch.Tensor, dec: NativeDecodes, column: int, scale: float,
                       softcap: float | None) -> torch.Tensor:
        """q [R, q_heads, head_dim] (float32) -> the same shape."""
        q = q.contiguous()
        out = torch.empty_like(q)
        pages = dec.pages[column]
        rows, q_heads, dim = q.shape
        _, _, block_size, kv_heads, _ = cache.shape
        status = self.lib.decode_attention(
            q.data_ptr(), cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            pages.data_ptr(), pages.shape[1], dec.first.data_ptr(), dec.last.data_ptr(), rows, q_heads, kv_heads,
            dim, block_size, scale, softcap or 0.0, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise MemoryError("hybridkv's CPU decode attention could not allocate its scores")
        return out

    @staticmethod
    def supports(q: torch.Tensor, cache: torch.Tensor) -> bool:
        """The kernel reads float32 queries and pools (head dims contiguous)."""
        return q.dtype == cache.dtype == torch.float32 and cache.stride(-1) == 1 and not cache.is_cuda


def check(attention: NativeAttention) -> None:
    """The kernel against dense torch on a small scattered pool: windows,
    GQA, soft-capping, rows of one key and of several blocks. Raises
    AssertionError on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    num_pages, bs, kv_heads, q_heads, dim = 24, 4, 2, 6, 80
    cache = torch.randn(num_pages, 2, bs, kv_heads, dim, generator=gen)
    positions, firsts = [0, 5, 13, 22], [0, 2, 0, 9]
    blocks = max(p // bs - f // bs for p, f in zip(positions, firsts)) + 1
    order = torch.randperm(num_pages, generator=gen)
    pages = torch.zeros(len(positions), blocks, dtype=torch.int64)
    for r, (p, f) in enumerate(zip(positions, firsts)):
        count = p // bs - f // bs + 1
        pages[r, :count] = order[r * 6:r * 6 + count]
    q = torch.randn(len(positions), q_heads, dim, generator=gen)
    dec = NativeDecodes(torch.arange(len(positions)), pages[None], torch.tensor(firsts), torch.tensor(positions))
    for softcap in (None, 5.0):
        got = attention.attend_decodes(q, cache, dec, 0, 0.3, softcap)
        for r, (p, f) in enumerate(zip(positions, firsts)):
            keys = torch.arange(f, p + 1)
            slots = pages[r, keys // bs - f // bs], keys % bs
            k, v = cache[slots[0], 0, slots[1]], cache[slots[0], 1, slots[1]]  # [n, kv_heads, dim]
            k = k.repeat_interleave(q_heads // kv_heads, dim=1)
            v = v.repeat_interleave(q_heads // kv_heads, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[r], k) * 0.3
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            expected = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
            assert torch.allclose(got[r], expected, atol=1e-5, rtol=1e-4), (r, softcap)
