"""The reference's recurrent side: every sequence's state gathered from the
pool, updated with the torch ops of mamba_ops.py, ssd_ops.py and
gated_delta_ops.py (every recurrent kind), scattered back (`finish`); states at checkpoints inside prefill chunks
copied aside between the passes of the scans (`save_states`)."""

from __future__ import annotations

from ...recurrent_state import GatheredPrefill, GatheredSteps, MambaMetadata, metadata
from ...step import StepInputs
from ..base import RecurrentOps


def gathered_build(inputs: StepInputs, buffers, read, write, saves=()) -> MambaMetadata:
    """Every sequence of the step on gathered states: sequence i's state is
    row i (its index in the step); the checkpoints inside chunks after them."""
    host = inputs.host
    meta = metadata(inputs, buffers, read, write, inputs.table_rows, None if host is None else host.chunks, saves)
    if inputs.decodes is not None:
        meta.step_rows = inputs.decodes.seqs
    return meta


class ReferenceRecurrent(GatheredSteps, GatheredPrefill, RecurrentOps):
    name = "torch"

    def build(self, inputs: StepInputs, buffers, read, write, zero, kind: str = "mamba", saves=()) -> MambaMetadata:
        return gathered_build(inputs, buffers, read, write, saves)
