"""Paged attention through FlashInfer (`pip install flashinfer-python`; a
CUDA device, 16-bit caches), reading hybridkv's pool in place.

A layer's cache is a view of the pool, `[pages, 2, block_size, kv_heads,
head_dim]` (layers/kv_buffers.py): `cache[:, 0]` and `cache[:, 1]` are FlashInfer's
"NHD" paged K and V, `[pages, page_size, heads, dim]`, with the pool's page
stride between pages (FlashInfer reads the page stride from the tensors, so
no copy is made). A request's pages are its table row in the layer's column.

FlashInfer takes a batch's pages as a CSR table (`paged_args`): per request
the pages it reads, from the block holding its first visible key to the one
holding its last, and how many slots of the last page are filled. The
kernel counts key positions from the first page it is given, and its
`window_left` masks keys more than `window_left` before the query, so:

* full attention: pages from block 0, no window (-1);
* sliding window W: pages from the block of `position - (W - 1)`,
  `window_left = W - 1` masks the first page's older slots;
* chunked local attention has a per-request start that no single window
  expresses unless chunks start on block boundaries, and a prefill chunk may
  cross a chunk boundary: not taken (the backend's capabilities leave it
  out, and the engine refuses the backend for such a model).

Attention sinks (gpt-oss) are not taken: FlashInfer 0.7.2's wrappers have
a `sinks` argument, but whether a kernel honours it depends on which of
its kernel backends the plan picks (some raise, e.g. cuDNN's), and
hybridkv has not run it against its reference on a GPU. The backend's
capabilities leave sinks out, so the engine refuses "flashinfer" for such
a model; "triton+flashinfer" runs their layers on its own kernels whole
and its prepare report says so.

Decode steps go through `BatchDecodeWithPagedKVCacheWrapper`, prefill
chunks through `BatchPrefillWithPagedKVCacheWrapper` (causal: FlashInfer
aligns a chunk's last query with the last key, which is where it is here).
The plans are made per step and per column (the layers of one column read
the same pages), from host data, so a step through FlashInfer is eager: not
captured as a CUDA graph (the backend declares `capturable=False`).

`emulate` is FlashInfer's documented semantics written in torch: the tests
check, on the CPU, that our arguments under those semantics give the
reference's attention; on a GPU the same arguments go to the kernels, and
`check` compares kernel and emulation before the engine trusts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ...step import AttentionStep
from ..base import AttentionOps
from ..triton import attention as triton_attention

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch for split-KV plans, per wrapper kind


class PagedArgs(NamedTuple):
    indptr: torch.Tensor  # [R + 1] int32: request r reads indices[indptr[r]:indptr[r + 1]]
    indices: torch.Tensor  # [pages read] int32: page numbers
    last_page_len: torch.Tensor  # [R] int32: filled slots of each request's last page (1 .. block_size)


def window_left(spec) -> int:
    """FlashInfer's `window_left` for a layer spec: -1 (no window) or W - 1."""
    if spec.kind == "sliding_window":
        return spec.sliding_window - 1
    if spec.kind == "full":
        return -1
    raise ValueError(f"FlashInfer takes full and sliding-window attention, not {spec.kind}")


def supports(spec, dtype: torch.dtype) -> bool:
    return spec.kind in ("full", "sliding_window") and dtype in (torch.float16, torch.bfloat16)


def paged_args(table: torch.Tensor, rows: torch.Tensor, first_key: torch.Tensor, last_key: torch.Tensor,
               block_size: int) -> PagedArgs:
    """The CSR page table of R requests: request r reads keys first_key[r]
    .. last_key[r] through row rows[r] of `table` ([table rows, blocks], one
    column's pages). Its pages run from the block of its first visible key to
    the block of its last key."""
    first_block = first_key // block_size
    last_block = last_key // block_size
    counts = last_block - first_block + 1
    indptr = torch.zeros(len(rows) + 1, dtype=torch.int32, device=table.device)
    indptr[1:] = torch.cumsum(counts, 0)
    blocks = torch.arange(table.shape[1], device=table.device)
    take = (blocks[None, :] >= first_block[:, None]) & (blocks[None, :] <= last_block[:, None])
    indices = table[rows][take].to(torch.int32)  # row-major: each request's pages in order
    return PagedArgs(indptr, indices, (last_key % block_size + 1).to(torch.int32))


def emulate(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, qo_indptr: torch.Tensor,
            args: PagedArgs, window: int, scale: float, softcap: float | None) -> torch.Tensor:
    """FlashInfer's batch paged attention as documented, in torch: request r
    has queries q[qo_indptr[r]:qo_indptr[r + 1]] (L of them) and keys, the
    pages indices[indptr[r]:indptr[r + 1]] with the last one filled to
    last_page_len[r] (kv_len of them). Query i sits at key position
    kv_len - L + i (causal) and reads keys from that minus `window`
    (window -1: from 0). Scores: q.k * scale, then softcap * tanh(s / softcap)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    for r in range(len(qo_indptr) - 1):
        pages = args.indices[args.indptr[r]:args.indptr[r + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(args.last_page_len[r])
        keys = k_pages[pages].reshape(-1, kv_heads, k_pages.shape[-1])[:kv_len].float()
        values = v_pages[pages].reshape(-1, kv_heads, v_pages.shape[-1])[:kv_len].float()
        queries = q[qo_indptr[r]:qo_indptr[r + 1]].float()
        at = kv_len - len(queries) + torch.arange(len(queries), device=q.device)
        key_pos = torch.arange(kv_len, device=q.device)
        visible = key_pos[None, :] <= at[:, None]
        if window >= 0:
            visible &= key_pos[None, :] >= (at - window)[:, None]
        groups = queries.shape[1] // kv_heads
        scores = torch.einsum("qhd,khd->hqk", queries, keys.repeat_interleave(groups, 1)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[qo_indptr[r]:qo_indptr[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1),
                                                          values.repeat_interleave(groups, 1))
    return out.to(q.dtype)


@dataclass
class FlashInferMetadata:
    step: AttentionStep
    decode_tokens: torch.Tensor | None  # [D] token rows of the decodes
    chunk_tokens: torch.Tensor | None  # [sum L] token rows of the chunks, chunk after chunk
    qo_indptr: torch.Tensor | None  # [C + 1] int32, the chunks' query ranges in chunk_tokens
    planned: dict = field(default_factory=dict)  # (column, kind, scale, softcap) -> a planned wrapper


def build(step: AttentionStep) -> FlashInferMetadata:
    inputs = step.inputs
    decodes, chunks = inputs.decodes, inputs.chunks
    chunk_tokens = qo_indptr = None
    if chunks is not None:
        lengths = chunks.lengths
        qo_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
        qo_indptr[1:] = torch.cumsum(lengths, 0)
        offsets = torch.arange(int(qo_indptr[-1]), device=lengths.device)
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
        chunk_tokens = chunks.starts[owner] + offsets - qo_indptr[:-1].long()[owner]
    return FlashInferMetadata(step, None if decodes is None else decodes.tokens, chunk_tokens, qo_indptr)


def decode_args(meta: FlashInferMetadata, column: int) -> PagedArgs:
    step, tokens = meta.step, meta.decode_tokens
    return paged_args(step.table[column], step.inputs.decodes.table_rows, step.first_key[tokens],
                      step.inputs.positions[tokens], step.block_size)


def chunk_args(meta: FlashInferMetadata, column: int) -> PagedArgs:
    """Per chunk: keys from its first query's first visible one to its last query."""
    step, chunks = meta.step, meta.step.inputs.chunks
    first = chunks.starts
    last = chunks.starts + chunks.lengths - 1
    return paged_args(step.table[column], chunks.table_rows, step.first_key[first], step.inputs.positions[last],
                      step.block_size)


class FlashInferAttention(AttentionOps):
    """The attention side of the "flashinfer" backend."""

    name = "flashinfer"
    build = staticmethod(build)

    def __init__(self, flashinfer, device: torch.device):
        self.flashinfer = flashinfer
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrappers: dict = {}  # (column, kind) -> wrapper, kept across steps (their buffers are reused)

    def store(self, cache, k, v, meta: FlashInferMetadata, column: int) -> None:
        # No slot past a request's last key is ever read (last_page_len),
        # so unlike the reference nothing needs zeroing.
        pages, offsets = meta.step.store_pages[column], meta.step.store_offsets
        cache[pages, 0, offsets] = k.to(cache.dtype)
        cache[pages, 1, offsets] = v.to(cache.dtype)

    def _planned(self, meta: FlashInferMetadata, column: int, kind: str, q, cache, scale, softcap):
        key = (column, kind, scale, softcap)
        wrapper = meta.planned.get(key)
        if wrapper is not None:
            return wrapper
        fi = self.flashinfer
        if (column, kind) not in self._wrappers:
            make = fi.BatchDecodeWithPagedKVCacheWrapper if kind == "decode" else fi.BatchPrefillWithPagedKVCacheWrapper
            self._wrappers[column, kind] = make(self.workspace, "NHD")
        wrapper = self._wrappers[column, kind]
        spec = meta.step.spec
        common = dict(window_left=window_left(spec), logits_soft_cap=softcap, sm_scale=scale,
                      q_data_type=q.dtype, kv_data_type=cache.dtype)
        heads, kv_heads, dim, bs = q.shape[1], cache.shape[3], cache.shape[4], cache.shape[2]
        if kind == "decode":
            args = decode_args(meta, column)
            wrapper.plan(args.indptr, args.indices, args.last_page_len, heads, kv_heads, dim, bs,
                         pos_encoding_mode="NONE", **common)
        else:
            args = chunk_args(meta, column)
            wrapper.plan(meta.qo_indptr, args.indptr, args.indices, args.last_page_len, heads, kv_heads, dim, bs,
                         causal=True, pos_encoding_mode="NONE", **common)
        meta.planned[key] = wrapper
        return wrapper

    def attend(self, q, cache, meta: FlashInferMetadata, column: int, scale, softcap=None, sinks=None):
        if sinks is not None:  # (the capabilities say so; the engine refuses such a model before a step)
            raise ValueError("FlashInfer's attention here takes no attention sinks")
        out = torch.empty_like(q)
        kv = (cache[:, 0], cache[:, 1])  # NHD views of the pool, in place
        if meta.decode_tokens is not None:
            wrapper = self._planned(meta, column, "decode", q, cache, scale, softcap)
            out[meta.decode_tokens] = wrapper.run(q[meta.decode_tokens], kv)
        if meta.chunk_tokens is not None:
            wrapper = self._planned(meta, column, "prefill", q, cache, scale, softcap)
            out[meta.chunk_tokens] = wrapper.run(q[meta.chunk_tokens], kv)
        return out


@dataclass
class PrefillSplitMetadata:
    kernel: object  # triton_attention.KernelMetadata: stores and decodes
    flashinfer: FlashInferMetadata | None  # an eager step's prefill chunks (its decodes left to the kernel)


class FlashInferPrefill(AttentionOps):
    """The attention side of the "triton+flashinfer" backend: hybridkv's
    kernels store K/V and run every decode (so fixed-shape decode steps are
    still captured as CUDA graphs, and an eager step plans nothing for its
    decodes), FlashInfer runs the prefill chunks of eager steps. On an H100
    (benchmarks/kernels.py, Gemma-3-27B attention, bf16) the two decoders
    are within 1% at the kernel's swept tiles, while FlashInfer's prefill
    took 0.51 ms against the kernel's 4.41 (2,048 queries after 6,144 keys)
    and 0.18 against 0.70 under a 1,024-key window. A group FlashInfer does
    not take (chunked-local, float32) and a layer with attention sinks stay
    on the kernels whole."""

    name = "triton+flashinfer"

    def __init__(self, flashinfer, device: torch.device, ops):
        self.ops = ops
        self.kernels = triton_attention.TritonAttention(ops)
        self.prefill = FlashInferAttention(flashinfer, device)

    def build(self, step: AttentionStep) -> PrefillSplitMetadata:
        chunked = step.inputs.chunks is not None and step.spec.kind in ("full", "sliding_window")
        meta = build(step) if chunked else None
        if meta is not None:
            meta.decode_tokens = None
        return PrefillSplitMetadata(triton_attention.build(step), meta)

    def store(self, cache, k, v, meta: PrefillSplitMetadata, column: int) -> None:
        self.kernels.store(cache, k, v, meta.kernel, column)

    def attend(self, q, cache, meta: PrefillSplitMetadata, column: int, scale, softcap=None, sinks=None):
        if meta.flashinfer is None or sinks is not None or not supports(meta.kernel.step.spec, cache.dtype):
            return self.kernels.attend(q, cache, meta.kernel, column, scale, softcap, sinks)
        out = self.prefill.attend(q, cache, meta.flashinfer, column, scale, softcap)  # the chunks' rows
        triton_attention.attend_decodes(self.ops, out, q, cache, meta.kernel.step, column, scale, softcap)
        return out


def check(attention: FlashInferAttention, device: torch.device, tolerance: float = 2e-2) -> None:
    """FlashInfer's decode and prefill kernels against `emulate` on a small
    random batch (bf16), full and windowed; raises on a mismatch."""
    gen = torch.Generator().manual_seed(0)
    pages, bs, kv_heads, groups, dim = 24, 16, 2, 2, 64
    cache = torch.randn(pages, 2, bs, kv_heads, dim, generator=gen).to(device, torch.bfloat16)
    lengths = torch.tensor([5, 37, 70])
    table = (torch.randperm(pages - 1, generator=gen)[:15] + 1).view(3, 5).to(device)
    q = torch.randn(3, kv_heads * groups, dim, generator=gen).to(device, torch.bfloat16)
    fi = attention.flashinfer
    for window in (-1, 19):
        first = (lengths - 1 - window).clamp(min=0) if window >= 0 else torch.zeros_like(lengths)
        args = paged_args(table, torch.arange(3, device=device), first.to(device), (lengths - 1).to(device), bs)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(attention.workspace, "NHD")
        wrapper.plan(args.indptr, args.indices, args.last_page_len, kv_heads * groups, kv_heads, dim, bs,
                     pos_encoding_mode="NONE", window_left=window, sm_scale=dim ** -0.5, q_data_type=q.dtype,
                     kv_data_type=cache.dtype)
        got = wrapper.run(q, (cache[:, 0], cache[:, 1]))
        want = emulate(q, cache[:, 0], cache[:, 1], torch.arange(4, dtype=torch.int32), args, window, dim ** -0.5,
                       None)
        error = (got.float() - want.float()).abs().max().item()
        if error > tolerance:
            raise RuntimeError(f"FlashInfer decode (window_left {window}) differs from its emulation by {error:.3g}")
        # Prefill: 4 and 9 queries at the end of 37 and 70 keys (causal).
        kv_lengths, q_lengths = lengths[1:], torch.tensor([4, 9])
        qo_indptr = torch.tensor([0, 4, 13], dtype=torch.int32)
        first_query = kv_lengths - q_lengths
        first = (first_query - window).clamp(min=0) if window >= 0 else torch.zeros_like(first_query)
        args = paged_args(table, torch.arange(1, 3, device=device), first.to(device), (kv_lengths - 1).to(device),
                          bs)
        queries = torch.randn(13, kv_heads * groups, dim, generator=gen).to(device, torch.bfloat16)
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(attention.workspace, "NHD")
        wrapper.plan(qo_indptr.to(device), args.indptr, args.indices, args.last_page_len, kv_heads * groups, kv_heads,
                     dim, bs, causal=True, pos_encoding_mode="NONE", window_left=window, sm_scale=dim ** -0.5,
                     q_data_type=queries.dtype, kv_data_type=cache.dtype)
        got = wrapper.run(queries, (cache[:, 0], cache[:, 1]))
        want = emulate(queries, cache[:, 0], cache[:, 1], qo_indptr, args, window, dim ** -0.5, None)
        error = (got.float() - want.float()).abs().max().item()
        if error > tolerance:
            raise RuntimeError(f"FlashInfer prefill (window_left {window}) differs from its emulation by {error:.3g}")
