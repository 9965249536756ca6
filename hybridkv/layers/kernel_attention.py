"""Paged attention through hybridkv's Triton kernels (triton_ops.py): the
same store and attend as the reference (paged_attention.py), reading the
pages in place through the persistent block tables instead of gathering.

Its metadata is what the kernels take: per token the position and the first
visible key (the read rule, `spec.first_visible`, applied once here on the
device), the store slots, and which rows are decodes and which prefill
segments. For a fixed-shape decode step every value is a tensor computed on
the device and every launch size comes from shapes: the step can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .step import StepInputs


@dataclass
class KernelMetadata:
    slots: torch.Tensor  # [width, tokens] page * block_size + offset of each new token, per column
    table: torch.Tensor  # [width, slots, max_blocks] the persistent tables
    positions: torch.Tensor  # [tokens]
    first_key: torch.Tensor  # [tokens] first key each query reads
    decode: tuple | None = None  # (rows, slot_rows) of the one-token sequences
    prefill: tuple | None = None  # (starts, lengths, slot_rows, longest) of the others


def build(inputs: StepInputs, table: torch.Tensor, spec, block_size: int) -> KernelMetadata:
    pos = inputs.positions
    slot_of_token = inputs.slot_rows[inputs.seq_of_token]
    slots = table[:, slot_of_token, pos // block_size] * block_size + pos % block_size
    meta = KernelMetadata(slots, table, pos, spec.first_visible(pos))
    host = inputs.host
    if host is None:  # fixed shapes: token t is sequence t's only token
        meta.decode = (torch.arange(pos.shape[0], device=pos.device), inputs.slot_rows)
        return meta
    device = pos.device

    def dev(a):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    decode = np.nonzero(host.counts == 1)[0]
    if decode.size:
        meta.decode = (dev(host.starts[decode]), dev(host.slot_rows[decode]))
    prefill = np.nonzero(host.counts > 1)[0]
    if prefill.size:
        meta.prefill = (dev(host.starts[prefill]), dev(host.counts[prefill]), dev(host.slot_rows[prefill]),
                        int(host.counts[prefill].max()))
    return meta


_sm_count: dict[int, int] = {}


def decode_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Key splits per decode program: enough programs to fill the GPU's SMs
    when requests x KV heads are few, never slices under 512 keys. From
    shapes only (the table's width bounds the keys), so a captured step
    keeps its value."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sms = _sm_count[index]
    if programs >= sms:
        return 1
    return max(1, min(16, -(-2 * sms // programs), max_keys // 512))


def store(ops, cache, k, v, meta: KernelMetadata, column: int) -> None:
    ops.store_kv(cache, k, v, meta.slots[column])


def attend(ops, q, cache, meta: KernelMetadata, column: int, scale, softcap):
    out = torch.empty_like(q)
    table = meta.table[column]
    if meta.decode is not None:
        rows, slot_rows = meta.decode
        splits = decode_splits(q.device, rows.shape[0] * cache.shape[3], table.shape[1] * cache.shape[2])
        ops.paged_decode_attention(out, q, cache, rows, table, slot_rows, meta.positions[rows], meta.first_key[rows],
                                   scale=scale, softcap=softcap, splits=splits)
    if meta.prefill is not None:
        starts, lengths, slot_rows, longest = meta.prefill
        ops.paged_prefill_attention(out, q, cache, starts, lengths, table, slot_rows, meta.positions, meta.first_key,
                                    max_length=longest, scale=scale, softcap=softcap)
    return out
