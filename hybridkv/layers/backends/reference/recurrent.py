"""The reference's recurrent ops, one class per kind: every sequence's state
gathered from the pool (`build`), moved on by the torch math of
mamba_ops.py, ssd_ops.py and gated_delta_ops.py, scattered back
(`finish`); states at checkpoints inside prefill chunks copied aside
between the passes of the scans (`save_states`). The other
implementations subclass a kind's class and replace what their kernels
run, so what they leave runs here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...gated_delta_ops import gated_delta_scan, gated_delta_step
from ...mamba_ops import causal_conv, causal_conv_step, selective_scan, selective_scan_step
from ...recurrent_state import RecurrentMetadata, finish, keep_accepted, metadata
from ...ssd_ops import ssd_scan, ssd_step
from ...step import StepInputs
from ..base import GatedDeltaOps, Mamba2Ops, MambaOps, RecurrentOps, ShortConvOps


def gathered_build(kind_metadata: type, inputs: StepInputs, buffers, read, write, saves=()) -> RecurrentMetadata:
    """Every sequence of the step on gathered states: sequence i's state is
    row i (its index in the step); the checkpoints inside chunks after them."""
    host = inputs.host
    meta = metadata(kind_metadata, inputs, buffers, read, write, inputs.table_rows,
                    None if host is None else host.chunks, saves)
    if inputs.decodes is not None:
        meta.step_rows = inputs.decodes.seqs
    return meta


# -- the state parts on gathered rows: part 0 the conv window, part 1 the recurrent state
def window_step(meta: RecurrentMetadata, layer_name: str, x, weight, bias) -> torch.Tensor:
    """The causal conv of one token for each decode row from its window,
    before any activation; the windows move on."""
    window = meta.state_views(layer_name)[0]
    rows = meta.step_rows
    y, new_window = causal_conv_step(x, window[rows], weight, bias)
    window[rows] = new_window.to(window.dtype)
    return y


def window_prefill(meta: RecurrentMetadata, layer_name: str, rows, x, lengths, weight, bias, keep) -> torch.Tensor:
    """The causal conv of chunks from the windows of `rows`, before any
    activation; the windows move on (with `keep`, each chunk's window
    before it and its inputs are kept, in `meta.verifies` order)."""
    window = meta.state_views(layer_name)[0]
    before = window[rows]
    y, new_window = causal_conv(x, lengths, before, weight, bias)
    window[rows] = new_window.to(window.dtype)
    if keep:
        meta.windows[layer_name] = torch.cat([before.to(x.dtype), x.transpose(1, 2)], 2)
    return y


def state_step(meta: RecurrentMetadata, layer_name: str, update, *inputs) -> torch.Tensor:
    """`update(*inputs, state)` of a kind on the decode rows' recurrent
    states, which move on."""
    state = meta.state_views(layer_name)[1]
    rows = meta.step_rows
    y, new_state = update(*inputs, state[rows])
    state[rows] = new_state.to(state.dtype)
    return y


def state_scan(meta, layer_name: str, rows, scan, inputs, lengths, keep) -> torch.Tensor:
    """`scan(*inputs, state, lengths, per_token)` of a kind from the
    recurrent states of `rows`, which move on (with `keep`, the state after
    each token goes to the kind's metadata's `token_states`)."""
    state = meta.state_views(layer_name)[1]
    y, new_state, per_token = scan(*inputs, state[rows], lengths, per_token=keep)
    state[rows] = new_state.to(state.dtype)
    if keep:
        meta.token_states[layer_name] = per_token
    return y


class Gathered(RecurrentOps):
    """What a kind's ops share on gathered states: every sequence's state
    gathered by `build`, written back by `finish`."""

    name = "torch"

    def build(self, inputs: StepInputs, buffers, read, write, zero, saves=()) -> RecurrentMetadata:
        return gathered_build(self.metadata_type, inputs, buffers, read, write, saves)

    def save_states(self, meta: RecurrentMetadata, layer_name: str, saves) -> None:
        source, checkpoint = saves
        for part in meta.state_views(layer_name):
            part[checkpoint] = part[source]

    finish = staticmethod(finish)

    def keep_accepted(self, meta: RecurrentMetadata, accepted: list[int]) -> None:
        keep_accepted(meta, accepted)


class GatheredCausalConv(Gathered):
    """A kind with a conv (SiLU'd) before its recurrent state."""

    def conv_step(self, meta, layer_name: str, x, weight, bias) -> torch.Tensor:
        return F.silu(window_step(meta, layer_name, x, weight, bias))

    def conv_prefill(self, meta, layer_name: str, rows, x, lengths, weight, bias, keep=False) -> torch.Tensor:
        return F.silu(window_prefill(meta, layer_name, rows, x, lengths, weight, bias, keep))

    def keep_accepted(self, meta, accepted: list[int]) -> None:
        keep_accepted(meta, accepted, meta.token_states)


class ReferenceMamba(GatheredCausalConv, MambaOps):
    def step(self, meta, layer_name, x, dt, A, B, C, D, gate):
        y = state_step(meta, layer_name, selective_scan_step, x, dt, A, B, C)
        return (y + x.float() * D) * F.silu(gate.float())

    def prefill(self, meta, layer_name, rows, x, dt, A, B, C, lengths, keep=False):
        return state_scan(meta, layer_name, rows, selective_scan, (x, dt, A, B, C), lengths, keep)


class ReferenceMamba2(GatheredCausalConv, Mamba2Ops):
    def step(self, meta, layer_name, x, dt, A, B, C, D):
        return state_step(meta, layer_name, ssd_step, x, dt, A, B, C, D)

    def prefill(self, meta, layer_name, rows, x, dt, A, B, C, D, lengths, keep=False):
        return state_scan(meta, layer_name, rows, ssd_scan, (x, dt, A, B, C, D), lengths, keep)


class ReferenceGatedDelta(GatheredCausalConv, GatedDeltaOps):
    def step(self, meta, layer_name, q, k, v, g, beta):
        return state_step(meta, layer_name, gated_delta_step, q, k, v, g, beta)

    def prefill(self, meta, layer_name, rows, q, k, v, g, beta, lengths, keep=False):
        return state_scan(meta, layer_name, rows, gated_delta_scan, (q, k, v, g, beta), lengths, keep)


class ReferenceShortConv(Gathered, ShortConvOps):
    def step(self, meta, layer_name, b, c, x, weight, bias):
        return c * window_step(meta, layer_name, b * x, weight, bias)

    def prefill(self, meta, layer_name, rows, b, c, x, lengths, weight, bias, keep=False):
        return c * window_prefill(meta, layer_name, rows, b * x, lengths, weight, bias, keep)


def recurrent_ops() -> dict[str, RecurrentOps]:
    """The reference's ops for every recurrent kind (`Backend.recurrent`)."""
    return {ops.kind: ops() for ops in (ReferenceMamba, ReferenceMamba2, ReferenceShortConv, ReferenceGatedDelta)}
