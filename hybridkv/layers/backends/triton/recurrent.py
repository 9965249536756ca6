"""The Triton kernels' recurrent ops, one class per kind they have kernels
for. Mamba-1 (`TritonMamba`): decode states stay in the pool (the kernels
read their read pages and write their write pages); prefill rows are
gathered and written back, scanned by a kernel (one program per chunk and
channel tile walking the tokens; the reference launches a few ops per
token), the conv and verified chunks (which keep every token's state) by
the reference; a chunk with checkpoints inside runs in pieces, the kernel
scanning each (layers/recurrent_state.py). Mamba-2 and Gated DeltaNet
(`TritonMamba2`, `TritonGatedDelta`): their groups are gathered whole,
decode rows too, and a kernel steps their float32 states in place, one
program per request, head and tile of channels walking the tokens
(decodes and chunks alike; the conv is the reference's; verified chunks,
which keep every token's state, and bfloat16 states run the reference).
Short-conv layers run the reference's ops (the prepare report says so)."""

from __future__ import annotations

import torch

from ...dtypes import TORCH_DTYPES
from ...recurrent_state import MambaMetadata, metadata
from ...step import StepInputs
from ..in_place import InPlaceGatedDelta, InPlaceSsd
from ..reference.recurrent import ReferenceGatedDelta, ReferenceMamba, ReferenceMamba2
from ..reference.recurrent import recurrent_ops as reference_ops


class TritonMamba(ReferenceMamba):
    name = "triton"

    def __init__(self, ops):
        self.ops = ops

    def build(self, inputs: StepInputs, buffers, read, write, zero, saves=()) -> MambaMetadata:
        decodes, chunks = inputs.decodes, inputs.chunks
        # Only the chunks run on gathered states (the reference scan), and
        # the checkpoints inside them after them.
        gathered = inputs.table_rows[:0] if chunks is None else chunks.table_rows
        meta = metadata(MambaMetadata, inputs, buffers, read, write, gathered, range(gathered.shape[0]), saves)
        if decodes is not None:
            rows = decodes.table_rows
            meta.step_pages = (read[rows], write[rows], zero[rows])
        return meta

    def _part(self, meta, layer_name, index):
        layout = meta.buffers.layout
        view = layout.layer_views[layer_name]
        spec = layout.groups[view.group].spec
        return view.offset + view.part_offsets[index], TORCH_DTYPES[spec.dtypes[index]]

    def conv_step(self, meta: MambaMetadata, layer_name: str, x, weight, bias):
        offset, dtype = self._part(meta, layer_name, 0)
        return self.ops.mamba_conv_step(meta.buffers.pool, *meta.step_pages, offset, dtype, x, weight, bias,
                                        silu=True)

    def step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D, gate):
        offset, dtype = self._part(meta, layer_name, 1)
        return self.ops.mamba_ssm_step(meta.buffers.pool, *meta.step_pages, offset, dtype, x, dt, A, B, C, D, gate)

    def prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, lengths, keep=False):
        if keep:  # verified drafts keep each token's state: the reference's scan
            return super().prefill(meta, layer_name, rows, x, dt, A, B, C, lengths, keep)
        state = meta.state_views(layer_name)[1]
        y, new_state = self.ops.selective_scan(x, dt, A, B, C, state[rows], lengths)
        state[rows] = new_state.to(state.dtype)
        return y


class TritonMamba2(InPlaceSsd, ReferenceMamba2):
    name = "triton"

    def __init__(self, ops):
        self.ops = ops

    def kernel(self, state, rows, x, dt, A, B, C, D, lengths):
        x, dt, A, B, C, D = (t.float().contiguous() for t in (x, dt, A, B, C, D))
        return self.ops.ssd(x, dt, A, B, C, D, lengths.to(torch.int64).contiguous(), state,
                            rows.to(torch.int64).contiguous())


class TritonGatedDelta(InPlaceGatedDelta, ReferenceGatedDelta):
    name = "triton"

    def __init__(self, ops):
        self.ops = ops

    def kernel(self, state, rows, q, k, v, g, beta, lengths):
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        return self.ops.gated_delta(q, k, v, g, beta, lengths.to(torch.int64).contiguous(), state,
                                    rows.to(torch.int64).contiguous())


def recurrent_ops(ops) -> dict:
    """The Triton ops for every recurrent kind: the short conv's are the
    reference's."""
    return {**reference_ops(), "mamba": TritonMamba(ops), "mamba2": TritonMamba2(ops),
            "gated_delta": TritonGatedDelta(ops)}
