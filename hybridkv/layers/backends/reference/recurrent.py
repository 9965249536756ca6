"""The reference's recurrent side: every sequence's state gathered from the
pool, updated with the torch ops of mamba_ops.py, scattered back (`finish`)."""

from __future__ import annotations

import torch.nn.functional as F

from ...mamba_ops import causal_conv_step, selective_scan_step
from ...recurrent_state import GatheredPrefill, MambaMetadata, metadata
from ...step import StepInputs
from ..base import RecurrentOps


class ReferenceRecurrent(GatheredPrefill, RecurrentOps):
    name = "torch"

    def build(self, inputs: StepInputs, buffers, read, write, zero) -> MambaMetadata:
        host = inputs.host
        meta = metadata(inputs, buffers, read, write, inputs.table_rows, None if host is None else host.chunks)
        if inputs.decodes is not None:
            meta.step_rows = inputs.decodes.seqs  # a sequence's state is row i: its index in the step
        return meta

    def conv_step(self, meta: MambaMetadata, layer_name: str, x, weight, bias):
        conv_state = meta.state_views(layer_name)[0]
        rows = meta.step_rows
        y, new_state = causal_conv_step(x, conv_state[rows], weight, bias)
        conv_state[rows] = new_state.to(conv_state.dtype)
        return F.silu(y)

    def ssm_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D, gate):
        ssm_state = meta.state_views(layer_name)[1]
        rows = meta.step_rows
        y, new_state = selective_scan_step(x, dt, A, B, C, ssm_state[rows])
        ssm_state[rows] = new_state.to(ssm_state.dtype)
        return (y + x.float() * D) * F.silu(gate.float())
