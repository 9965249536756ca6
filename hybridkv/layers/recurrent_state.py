"""Where a recurrent (Mamba) layer's per-request state lives during a step,
shared by every backend's recurrent side (backends/base.py, RecurrentOps):
the reference gathers every sequence's state from the pool into one tensor
and scatters them back after the forward (`finish`); the Triton kernels
update decode states in the pool in place, from their read pages to their
write pages. Prefill chunks run on gathered states in every backend
(`GatheredPrefill`: the reference scan of mamba_ops.py).

Per request the manager gives a read block (None: the zero state, read as
the null page, which stays zero) and a write block (the same block when the
update is in place); the runner keeps them per running sequence in
persistent tables (`read`, `write` `[table rows, pages per block]`, and
`zero` `[table rows]` for the kernels, which skip the read). The step's split
into decodes and chunks comes built (`StepInputs`, step.py); a fixed-shape
step reads the tables with device gathers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .kv_buffers import KVBuffers
from .mamba_ops import causal_conv, selective_scan
from .step import StepInputs


class Verified(NamedTuple):
    row: int  # state row
    start: int  # first token row
    count: int  # the sampled token and the drafts
    sequence: int  # index of the sequence in the step


@dataclass
class MambaMetadata:
    buffers: KVBuffers
    states: torch.Tensor  # [R, state bytes] gathered states (rows: see the backends)
    write_pages: torch.Tensor  # [R, pages per block] where those rows go after the step
    step_tokens: torch.Tensor | None  # token rows of the sequences with one token this step
    num_steps: int  # how many: the layers skip the step ops at 0
    step_rows: torch.Tensor | None = None  # reference: their rows of `states`
    step_pages: tuple | None = None  # kernels: their (read, write, zero) pages in the pool
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (state row, first token row, count)
    # Sequences verifying drafts: chunks like prefills, but the layers keep
    # each token's state (`verify_states`) until keep_accepted picks one.
    verifies: list["Verified"] = field(default_factory=list)
    verify_states: dict = field(default_factory=dict)  # layer name -> [conv window, per-token SSM states]

    def state_views(self, layer_name: str) -> list[torch.Tensor]:
        """The layer's conv and SSM states inside `states` (typed views)."""
        return self.buffers.state_views(self.states, layer_name)


def gather(buffers: KVBuffers, read: torch.Tensor) -> torch.Tensor:
    """States read from their pages, `[R, state bytes]`. A sequence with no
    state yet reads the null page, which holds zeros (nothing ever writes
    it): the zero state without a pass to clear it."""
    return buffers.pool[read].reshape(read.shape[0], read.shape[1] * buffers.page_size)


def chunk_lists(host, state_rows) -> tuple[list[tuple[int, int, int]], list[Verified]]:
    """The step's chunks as (state row, first token row, count), `state_rows`
    giving each chunk's row of the gathered states: prefill chunks, and the
    verified ones, longest first (the order the scan takes them in)."""
    chunks = [(int(r), int(host.starts[i]), int(host.counts[i])) for r, i in zip(state_rows, host.chunks)]
    if host.verifying is None:
        return chunks, []
    verifying = host.verifying[host.chunks]
    verified = [Verified(*c, int(i)) for c, i, v in zip(chunks, host.chunks, verifying) if v]
    return [c for c, v in zip(chunks, verifying) if not v], sorted(verified, key=lambda v: -v.count)


def metadata(inputs: StepInputs, buffers: KVBuffers, read, write, gathered, chunk_rows) -> MambaMetadata:
    """What both backends share: the states of table rows `gathered` (their
    read pages) and where they go, the decodes' token rows, the chunks, each
    at its row `chunk_rows[i]` of the gathered states (host)."""
    decodes = inputs.decodes
    meta = MambaMetadata(buffers, gather(buffers, read[gathered]), write[gathered],
                         None if decodes is None else decodes.tokens,
                         0 if decodes is None else decodes.tokens.shape[0])
    if not inputs.fixed_shape:
        meta.prefills, meta.verifies = chunk_lists(inputs.host, chunk_rows)
    return meta


def finish(meta: MambaMetadata) -> None:
    """Write the gathered states to their write pages."""
    rows = meta.write_pages.shape[0]
    if rows:
        meta.buffers.pool[meta.write_pages] = meta.states.view(rows, meta.write_pages.shape[1], -1)


class GatheredPrefill:
    """The parts of RecurrentOps every backend runs on gathered states:
    the chunked prefill (mamba_ops.py's scan, side by side), `finish`, and
    the rollback after verified drafts."""

    finish = staticmethod(finish)

    def conv_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, lengths, weight, bias, keep=False):
        conv_state = meta.state_views(layer_name)[0]
        before = conv_state[rows]
        y, new_conv = causal_conv(x, lengths, before, weight, bias)
        conv_state[rows] = new_conv.to(conv_state.dtype)
        if keep:  # in meta.verifies order (keep_accepted picks one state per chunk)
            meta.verify_states.setdefault(layer_name, [None, None])[0] = \
                torch.cat([before.to(x.dtype), x.transpose(1, 2)], 2)
        return F.silu(y)

    def ssm_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, lengths, keep=False):
        ssm_state = meta.state_views(layer_name)[1]
        y, new_ssm, per_token = selective_scan(x, dt, A, B, C, ssm_state[rows], lengths, per_token=keep)
        ssm_state[rows] = new_ssm.to(ssm_state.dtype)
        if keep:
            meta.verify_states.setdefault(layer_name, [None, None])[1] = per_token
        return y

    def keep_accepted(self, meta: MambaMetadata, accepted: list[int]) -> None:
        keep_accepted(meta, accepted)


def keep_accepted(meta: MambaMetadata, accepted: list[int]) -> None:
    """After verification (one count per `meta.verifies` entry: the drafts
    kept): write the state after each sequence's last kept token to its write
    pages, over the state after its last draft that the pass left there.
    From the per-token states the layers kept: the SSM state after token j,
    and the conv state, which is the K-1 inputs before token j + 1."""
    redo = [(j, a) for j, (v, a) in enumerate(zip(meta.verifies, accepted)) if a < v.count - 1]
    if not redo:
        return  # every draft kept: the pass's final state is the one
    device = meta.states.device
    index = torch.tensor([j for j, _ in redo], device=device)
    kept = torch.tensor([a for _, a in redo], device=device)
    rows = torch.tensor([meta.verifies[j].row for j, _ in redo], device=device)
    states = meta.states[rows]  # a copy: every layer's parts, patched below
    for layer_name, (window, per_token) in meta.verify_states.items():
        conv, ssm = meta.buffers.state_views(states, layer_name)
        width = conv.shape[-1]
        w = window[index]  # [r, I, K-1 + L]: the conv state before the chunk, then its inputs
        at = (kept[:, None] + 1 + torch.arange(width, device=device))[:, None, :].expand(-1, w.shape[1], -1)
        conv.copy_(w.gather(2, at))
        ssm.copy_(per_token[index, kept])
    pages = meta.write_pages[rows]
    meta.buffers.pool[pages] = states.view(len(redo), pages.shape[1], -1)
