"""Attention on the CPU through hybridkv's C kernel (kernels.c): the
decode queries of an eager step read their keys where they lie in the
pool, each its own range, in one call per layer; stores, prefill chunks and
fixed-shape steps (the ones torch.compile traces) stay the torch
reference's (backends/reference), whose metadata this extends.

Attention sinks are the kernel's too (`sinks`, one logit per query head).
Queries and pages are float32 or bfloat16 (`STORAGE`), each its own; the
kernel's sums and softmax are float32, its output rounded once (the
reference rounds its scores and weights to bfloat16 too).

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

from ...kv_quant import QuantizedCache, rotation
from ...step import AttentionStep
from ..base import AttentionOps
from ..reference import attention as torch_attention

# kernels.c's storage types (its `enum { F32, BF16, I8, E4M3, E5M2 }`), by
# torch dtype: what queries, activations and pages may be, and the codes of
# quantized pages its decode attention reads and its decoder layer writes
# (with their scales: kv_quant.py).
STORAGE = {torch.float32: 0, torch.bfloat16: 1}
CODES = {torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


@dataclass
class CpuDecodes:
    """The step's decode queries as the kernel reads them."""

    rows: torch.Tensor  # [R] query rows in the step's token tensor
    pages: torch.Tensor  # [width, R, blocks] int64: each row's pages from the block of its first key
    first: torch.Tensor  # [R] int64: first key position each row reads
    last: torch.Tensor  # [R] int64: its own position, the last key it reads


@dataclass
class CpuPrefills:
    """The step's prefill chunks as kernels.c's `prefill_attention` reads
    them (its `prefill_rows`; the struct points into these tensors)."""

    chunks: torch.Tensor  # [5, S] int64: start, count, query_pos, key_pos, keys of each chunk
    pages: torch.Tensor  # [width, S, blocks] int64: each chunk's pages from its first key's block
    first: torch.Tensor  # [T] int64: the first key position each row of the step reads

    def rows(self, lib, column: int):
        c = self.chunks
        return lib.structs["prefill_rows"](c.shape[1], self.pages.shape[2], c[0].data_ptr(), c[1].data_ptr(),
                                           c[2].data_ptr(), c[3].data_ptr(), c[4].data_ptr(),
                                           self.pages[column].data_ptr(), self.first.data_ptr())


def prefills(step: AttentionStep, segments: list) -> CpuPrefills | None:
    if not segments:
        return None
    blocks = max(seg.pages.shape[-1] for seg in segments)
    pages = torch.zeros(step.table.shape[0], len(segments), blocks, dtype=torch.int64)
    for i, seg in enumerate(segments):
        pages[:, i, :seg.pages.shape[-1]] = seg.pages
    chunks = torch.tensor([[seg.start, seg.length, seg.query_pos, seg.key_pos, seg.pages.shape[-1] * step.block_size]
                           for seg in segments], dtype=torch.int64).t().contiguous()
    return CpuPrefills(chunks, pages, step.first_key.to(torch.int64).contiguous())


@dataclass
class CpuMetadata:
    reference: torch_attention.AttentionMetadata  # stores and prefill chunks (its `decodes` left empty)
    decodes: CpuDecodes | None
    step: AttentionStep  # for the reference's decode groups, where the kernel cannot read a pool

    @cached_property
    def reference_decodes(self) -> list[torch_attention.DecodeGroup]:
        """Built on first need, once for all the group's layers."""
        return torch_attention.decode_group_list(self.step)

    @cached_property
    def prefills(self) -> CpuPrefills | None:
        """The chunks for `prefill_attention`, built on first need (a
        bfloat16 step on a CPU with AMX), once for all the group's layers."""
        return prefills(self.step, self.reference.prefills)


def decodes(step: AttentionStep) -> CpuDecodes | None:
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
    return CpuDecodes(inputs.decodes.tokens, pages, torch.from_numpy(first), torch.from_numpy(last))


class CpuAttention(AttentionOps):
    """The attention side of the "cpu" backend."""

    name = "cpu"
    # Prefill tiles' softmax in one C pass (True), or torch's passes (False:
    # benchmarks/prefill_tiles.py compares the two).
    fused_softmax = True
    # bfloat16 prefill chunks on AMX tiles where the kernels have them
    # (True), or the tiles' path (False: benchmarks/prefill_tiles.py).
    amx_prefill = True
    amx_prefill_calls = 0  # layers' prefill chunks it ran (benchmarks/prefill_tiles.py checks its runs took it)

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def build(step: AttentionStep):
        if step.inputs.fixed_shape:
            return torch_attention.build(step)
        reference = torch_attention.AttentionMetadata(step.spec, step.store_pages, step.store_offsets,
                                                      *torch_attention.tails(step), [],
                                                      torch_attention.prefill_segments(step))
        return CpuMetadata(reference, decodes(step), step)

    @staticmethod
    def store(cache, k, v, meta, column):
        torch_attention.store(cache, k, v, meta.reference if isinstance(meta, CpuMetadata) else meta, column)

    def attend(self, q, cache, meta, column, scale, softcap=None, sinks=None):
        if not isinstance(meta, CpuMetadata):
            return torch_attention.attend(q, cache, meta, column, scale, softcap, sinks)
        if isinstance(cache, QuantizedCache) and cache.rotation is not None:  # rotated int8 rows (kv_quant.py)
            if not self.supports(q, cache):
                return torch_attention.attend(q, cache, meta, column, scale, softcap, sinks)
            # Decodes: the kernel rotates each query and output itself (a
            # fast transform per row); prefill chunks: the reference's, over
            # rotated queries, their output rotated back.
            ref = meta.reference
            out = torch.empty_like(q)
            if ref.prefills:
                weights = self.tile_weights if self.fused_softmax else None
                torch_attention.attend_prefills(self.rotated(q), cache, ref.spec, ref.prefills, column, scale,
                                                softcap, out, sinks, weights)
                out = self.rotated(out)
            if meta.decodes is not None:
                out[meta.decodes.rows] = self.attend_decodes(q[meta.decodes.rows], cache, meta.decodes, column,
                                                             scale, softcap, sinks)
            return out
        out = torch.empty_like(q)
        if meta.decodes is not None and not self.supports(q, cache):
            for group in meta.reference_decodes:
                keys, values = torch_attention.gather(cache, group.pages, column)
                out[group.rows] = torch_attention.attend_decodes(q[group.rows], keys.to(q.dtype), values.to(q.dtype),
                                                                 group.mask, scale, softcap, sinks)
        elif meta.decodes is not None:
            out[meta.decodes.rows] = self.attend_decodes(q[meta.decodes.rows], cache, meta.decodes, column, scale,
                                                         softcap, sinks)
        ref = meta.reference
        if ref.prefills and self.attend_prefills(q, cache, meta.prefills, column, scale, softcap, sinks, out):
            return out
        weights = self.tile_weights if self.fused_softmax and q.dtype in STORAGE else None
        torch_attention.attend_prefills(q, cache, ref.spec, ref.prefills, column, scale, softcap, out, sinks, weights)
        return out

    def attend_prefills(self, q, cache, chunks: CpuPrefills, column: int, scale: float, softcap: float | None,
                        sinks: torch.Tensor | None, out: torch.Tensor) -> bool:
        """The prefill chunks' rows of `out`, on AMX tiles (kernels.c
        `prefill_attention`: bfloat16 queries and pages, heads a multiple
        of 32 wide); False where it does not run (the caller then runs the
        tiles' path)."""
        if not (self.amx_prefill and self.lib.amx_prefill_attention) or q.dtype != torch.bfloat16 or \
                isinstance(cache, QuantizedCache) or cache.dtype != torch.bfloat16 or cache.stride(-1) != 1 or \
                cache.shape[-1] % 32 or not q.is_contiguous():
            return False
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        status = self.lib.prefill_attention(paged_cache(self.lib, cache), chunks.rows(self.lib, column), q.data_ptr(),
                                            q.shape[1], scale, softcap or 0.0,
                                            None if sinks is None else sinks.data_ptr(), out.data_ptr(),
                                            STORAGE[q.dtype], torch.get_num_threads())
        if status == -1:
            raise MemoryError("hybridkv's CPU prefill attention could not allocate its scratch")
        if status == -4:  # Linux refused the tiles' state: the tiles' path from now on, said in the backend's report
            self.lib.amx_prefill_attention = False
            self.lib.amx_refused = True
        self.amx_prefill_calls += status == 0
        return status == 0

    def tile_weights(self, scores: torch.Tensor, visible: torch.Tensor, scale: float, softcap: float | None,
                     sinks: torch.Tensor | None) -> torch.Tensor:
        """A prefill tile's softmax weights, in place of its scores [rows,
        groups, keys] (float32 or bfloat16, dense; `visible` [rows, keys]
        bool): one pass of the C kernel `masked_softmax` where torch makes
        four over the tile (scale, mask, softmax, rounding) and a float32
        copy of it."""
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        if visible.stride(-1) != 1:
            visible = visible.contiguous()
        rows, groups, keys = scores.shape
        status = self.lib.masked_softmax(scores.data_ptr(), visible.data_ptr(), visible.stride(0), rows, groups, keys,
                                         scale, softcap or 0.0, None if sinks is None else sinks.data_ptr(),
                                         scores.data_ptr(), STORAGE[scores.dtype], torch.get_num_threads())
        if status != 0:
            raise MemoryError("hybridkv's CPU prefill softmax could not allocate its scratch rows")
        return scores

    def rotated(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] times the orthonormal Hadamard matrix of order n
        (kv_quant.rotation), in x's dtype: the C fast transform
        (`rotate_rows`) on a float32 copy, n log n sums a row where the
        product with the matrix takes n^2 (most of an int8 prefill's extra
        time over float pages)."""
        y = torch.empty(x.shape, dtype=torch.float32).copy_(x)
        n = y.shape[-1]
        if self.lib.rotate_rows(y.data_ptr(), y.numel() // n, n, n, torch.get_num_threads()) != 0:
            raise ValueError(f"hybridkv's CPU rotation: rows of {n} elements, no power of two")
        return y.to(x.dtype)

    def attend_decodes(self, q: torch.Tensor, cache: torch.Tensor, dec: CpuDecodes, column: int, scale: float,
                       softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [R, q_heads, head_dim] (float32 or bfloat16) -> the same shape
        and dtype; sinks [q_heads] or None."""
        q = q.contiguous()
        out = torch.empty_like(q)
        pages = dec.pages[column]
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        apart = {}
        if isinstance(cache, QuantizedCache) and cache.scale_column is not None:  # the scales' own pages
            apart["scale_pages"] = dec.pages[cache.scale_column].data_ptr()
        rows = self.lib.structs["decode_rows"](rows=q.shape[0], max_blocks=pages.shape[1], pages=pages.data_ptr(),
                                               first=dec.first.data_ptr(), last=dec.last.data_ptr(), **apart)
        status = self.lib.decode_attention(paged_cache(self.lib, cache), rows, q.data_ptr(), q.shape[1], scale,
                                           softcap or 0.0, None if sinks is None else sinks.data_ptr(),
                                           out.data_ptr(), STORAGE[q.dtype], torch.get_num_threads())
        if status == -2:
            raise ValueError("hybridkv's CPU decode attention: quantized queries, quantized pages without their "
                             "scales, or rotated rows whose width is no power of two")
        if status != 0:
            raise MemoryError("hybridkv's CPU decode attention could not allocate its scores")
        return out

    @staticmethod
    def supports(q: torch.Tensor, cache) -> bool:
        """The kernel reads float32 and bfloat16 queries, and pools of those
        or of int8 / float8 codes with their scales (head dims contiguous), on the CPU."""
        if isinstance(cache, QuantizedCache):
            return q.dtype in STORAGE and cache.dtype in CODES and cache.codes.stride(-1) == 1 and \
                cache.scales.stride(-1) == 1 and cache.device.type == "cpu"
        return q.dtype in STORAGE and cache.dtype in STORAGE and cache.stride(-1) == 1 and cache.device.type == "cpu"


def paged_cache(lib, cache):
    """kernels.c's `paged_cache` for a layer's view of the pool: float32 or
    bfloat16 (`STORAGE`), or int8 / float8 codes and their scales (`CODES`)."""
    if isinstance(cache, QuantizedCache):  # rows rotated where kv_quant says: the kernels rotate the queries
        codes, scales = cache.codes, cache.scales
        turned = rotation(codes.dtype, codes.shape[-1], codes.device) is not None
        return lib.structs["paged_cache"](codes.data_ptr(), *codes.stride()[:4], codes.shape[2], codes.shape[3],
                                          codes.shape[4], CODES[codes.dtype], scales.data_ptr(), *scales.stride(),
                                          int(turned))
    return lib.structs["paged_cache"](cache.data_ptr(), *cache.stride()[:4], cache.shape[2], cache.shape[3],
                                      cache.shape[4], STORAGE[cache.dtype])
