"""The Triton kernels' recurrent side: decode states of the kinds it has
kernels for (`kinds`: Mamba-1's conv and SSM steps) stay in the pool (the
kernels read their read pages and write their write pages); prefill rows
are gathered and written back, Mamba-1's scanned by a kernel (one program
per chunk and channel tile walking the tokens; the reference launches a
few ops per token), the conv and verified chunks (which keep every
token's state) by the reference; a chunk with checkpoints inside runs
in pieces, the kernel scanning each (layers/recurrent_state.py). Mamba-2
and Gated DeltaNet groups are gathered whole, decode rows too, and a
kernel steps their float32 states in place, one program per request, head
and tile of channels walking the tokens (decodes and chunks alike; the
conv is the reference's; verified chunks, which keep every token's state,
and bfloat16 states run the reference). Short-conv groups are gathered
whole and run the reference's ops (the prepare report says so)."""

from __future__ import annotations

import torch

from ...dtypes import TORCH_DTYPES
from ...recurrent_state import InPlaceRecurrences, MambaMetadata, metadata
from ...step import StepInputs
from ..reference.recurrent import ReferenceRecurrent, gathered_build


class TritonRecurrent(InPlaceRecurrences, ReferenceRecurrent):
    name = "triton"
    kinds = frozenset({"mamba", "mamba2", "gated_delta"})
    in_pool = frozenset({"mamba"})  # the kinds whose decode states the kernels read and write in the pool

    def __init__(self, ops):
        self.ops = ops

    def build(self, inputs: StepInputs, buffers, read, write, zero, kind: str = "mamba", saves=()) -> MambaMetadata:
        if kind not in self.in_pool:
            return gathered_build(inputs, buffers, read, write, saves)
        decodes, chunks = inputs.decodes, inputs.chunks
        # Only the chunks run on gathered states (the reference scan), and
        # the checkpoints inside them after them.
        gathered = inputs.table_rows[:0] if chunks is None else chunks.table_rows
        meta = metadata(inputs, buffers, read, write, gathered, range(gathered.shape[0]), saves)
        if decodes is not None:
            rows = decodes.table_rows
            meta.step_pages = (read[rows], write[rows], zero[rows])
        return meta

    def _part(self, meta, layer_name, index):
        layout = meta.buffers.layout
        view = layout.layer_views[layer_name]
        spec = layout.groups[view.group].spec
        return view.offset + view.part_offsets[index], TORCH_DTYPES[spec.dtypes[index]]

    # A group `build` gathered whole (a kind without kernels) has no
    # step pages: its decodes take the reference's ops.
    def conv_step(self, meta: MambaMetadata, layer_name: str, x, weight, bias):
        if meta.step_pages is None:
            return super().conv_step(meta, layer_name, x, weight, bias)
        offset, dtype = self._part(meta, layer_name, 0)
        return self.ops.mamba_conv_step(meta.buffers.pool, *meta.step_pages, offset, dtype, x, weight, bias,
                                        silu=True)

    def ssm_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D, gate):
        if meta.step_pages is None:
            return super().ssm_step(meta, layer_name, x, dt, A, B, C, D, gate)
        offset, dtype = self._part(meta, layer_name, 1)
        return self.ops.mamba_ssm_step(meta.buffers.pool, *meta.step_pages, offset, dtype, x, dt, A, B, C, D, gate)

    # Mamba-2 and Gated DeltaNet: their groups are gathered whole (no step
    # pages); the kernels step the gathered float32 states in place
    # (recurrent_state.InPlaceRecurrences decides when).
    def ssd_kernel(self, state, rows, x, dt, A, B, C, D, lengths):
        x, dt, A, B, C, D = (t.float().contiguous() for t in (x, dt, A, B, C, D))
        return self.ops.ssd(x, dt, A, B, C, D, lengths.to(torch.int64).contiguous(), state,
                            rows.to(torch.int64).contiguous())

    def gated_delta_kernel(self, state, rows, q, k, v, g, beta, lengths):
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        return self.ops.gated_delta(q, k, v, g, beta, lengths.to(torch.int64).contiguous(), state,
                                    rows.to(torch.int64).contiguous())

    def ssm_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, lengths, keep=False):
        if keep:  # verified drafts keep each token's state: the reference's scan
            return super().ssm_prefill(meta, layer_name, rows, x, dt, A, B, C, lengths, keep)
        state = meta.state_views(layer_name)[1]
        y, new_state = self.ops.selective_scan(x, dt, A, B, C, state[rows], lengths)
        state[rows] = new_state.to(state.dtype)
        return y
