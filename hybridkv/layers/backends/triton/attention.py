"""Paged attention through hybridkv's Triton kernels (ops.py): the
same store and attend as the reference (backends/reference), reading the
pages in place through the persistent block tables instead of gathering.

The kernels take the step as every backend shares it (`AttentionStep`,
layers/step.py): per token its position and first visible key, the decodes' token
and table rows, the chunks' starts, lengths and table rows. Their own part
is the store slot of each new token. In a fixed-shape step every value is a
tensor computed on the device and every launch size comes from shapes: the
step can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kv_quant import QuantizedCache, rotated
from ...step import AttentionStep
from ..base import AttentionOps


@dataclass
class KernelMetadata:
    step: AttentionStep
    slots: torch.Tensor  # [width, tokens] page * block_size + offset of each new token, per column


def build(step: AttentionStep) -> KernelMetadata:
    return KernelMetadata(step, step.store_pages * step.block_size + step.store_offsets)


_sm_count: dict[int, int] = {}


def decode_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Key splits per decode program: enough programs to fill the GPU's SMs
    when requests x KV heads are few, never slices under 512 keys. From
    shapes only (the table's width bounds the keys), so a captured step
    keeps its value. A power of two: each value is a kernel variant that
    Triton compiles (seconds, for wide heads), and a mixed step's decodes
    come in any number, so the values must be few (1, 2, 4, 8, 16)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sms = _sm_count[index]
    if programs >= sms:
        return 1
    splits = max(1, min(16, -(-2 * sms // programs), max_keys // 512))
    return 1 << (splits.bit_length() - 1)


def decode_block_n(kind: str, head_dim: int, element_size: int) -> int:
    """Keys per tile of the decode kernel. From the tile sweep of
    benchmarks/kernels.py on an H100 (64 requests x 8K and 32K, head_dim
    128, bf16): 128 for full attention (2.96 TB/s against 2.73 at 64), 32
    for a sliding window of 1,024 keys (2.65 against 2.39). Wider heads and
    float32 caches keep 64 (unmeasured there; larger float32 tiles spill
    registers on sm_90)."""
    if head_dim > 128 or element_size >= 4:
        return 64
    return 32 if kind == "sliding_window" else 128


class TritonAttention(AttentionOps):
    name = "triton"

    def __init__(self, ops):
        self.ops = ops

    build = staticmethod(build)

    def store(self, cache, k, v, meta: KernelMetadata, column: int) -> None:
        if isinstance(cache, QuantizedCache):  # codes and scales (kv_quant.py); int8 rows rotated first
            h = cache.rotation
            if h is not None:
                k, v = rotated(k, h), rotated(v, h)
            self.ops.store_codes(cache.codes, cache.scales, k, v, meta.slots[column],
                                 meta.slots[cache.scales_at(column)])
            return
        self.ops.store_kv(cache, k, v, meta.slots[column])

    def attend(self, q, cache, meta: KernelMetadata, column: int, scale, softcap=None, sinks=None):
        if isinstance(cache, QuantizedCache) and cache.rotation is not None:
            # rotated int8 rows: the queries rotated alike, the output back (kv_quant.py)
            h = cache.rotation
            return rotated(self.attend(rotated(q, h), cache.unrotated(), meta, column, scale, softcap, sinks), h)
        out = torch.empty_like(q)
        attend_decodes(self.ops, out, q, cache, meta.step, column, scale, softcap, sinks)
        step = meta.step
        chunks = step.inputs.chunks
        if chunks is not None:
            self.ops.paged_prefill_attention(out, q, cache, chunks.starts, chunks.lengths, step.table[column],
                                             chunks.table_rows, step.inputs.positions, step.first_key,
                                             max_length=chunks.longest, scale=scale, softcap=softcap, sinks=sinks,
                                             scale_tables=scale_table(step, cache, column))
        return out


def attend_decodes(ops, out, q, cache, step: AttentionStep, column: int, scale, softcap, sinks=None) -> None:
    """The step's decode rows of `out` (the prefill chunks' rows untouched)."""
    decodes = step.inputs.decodes
    if decodes is None:
        return
    positions, table, tokens = step.inputs.positions, step.table[column], decodes.tokens
    splits = decode_splits(q.device, tokens.shape[0] * cache.shape[3], table.shape[1] * cache.shape[2])
    width = (cache.codes if isinstance(cache, QuantizedCache) else cache).element_size()
    ops.paged_decode_attention(out, q, cache, tokens, table, decodes.table_rows, positions[tokens],
                               step.first_key[tokens], scale=scale, softcap=softcap, sinks=sinks, splits=splits,
                               block_n=decode_block_n(step.spec.kind, cache.shape[4], width),
                               scale_tables=scale_table(step, cache, column))


def scale_table(step: AttentionStep, cache, column: int) -> torch.Tensor | None:
    """The table column of a quantized layer's scales where they lie in
    pages of their own (kv_quant.QuantizedCache.scale_column), else None."""
    if isinstance(cache, QuantizedCache) and cache.scale_column is not None:
        return step.table[cache.scale_column]
    return None
