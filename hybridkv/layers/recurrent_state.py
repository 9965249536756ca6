"""Where a recurrent layer's per-request state lives during a step, shared
by every backend's recurrent side (backends/base.py, RecurrentOps): the
reference gathers every sequence's state from the pool into one tensor
and scatters them back after the forward (`finish`); the Triton kernels
update decode states in the pool in place, from their read pages to their
write pages. Prefill chunks run on gathered states in every backend
(`GatheredPrefill`: the reference scans of mamba_ops.py, ssd_ops.py and
gated_delta_ops.py, for every recurrent kind), and so do the decodes of a
kind a backend has no kernel for (`GatheredSteps`).

A state is parts (the spec's shapes): part 0 is the causal conv's window
for every kind here (the K-1 inputs before the next token), part 1 the
recurrent state where the kind has one (Mamba-1 [I, N], Mamba-2 [H, P, N]).

A checkpoint inside a prefill chunk (the manager's `get_checkpoint_pages`,
the build's `saves`) gets a gathered row of its own after the others and
its pages among the write pages; the chunk runs in pieces cut at its
checkpoints, one pass of the layers' prefill ops per piece (`passes`), and
after the pass that ends at a checkpoint each layer copies its state to
that row (`save_states`): the state a chunk ending there would leave.

Per request the manager gives a read block (None: the zero state, read as
the null page, which stays zero) and a write block (the same block when the
update is in place); the worker keeps them per running sequence in
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
from .gated_delta_ops import gated_delta_scan, gated_delta_step
from .mamba_ops import causal_conv, causal_conv_step, selective_scan, selective_scan_step
from .ssd_ops import ssd_scan, ssd_step
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
    # layer name -> [the conv window over the chunk, the recurrent state after each token (or None)]
    verify_states: dict = field(default_factory=dict)
    # What the layers' prefill ops run, pass after pass: (chunks as
    # `prefills`, keep, None or (state rows, checkpoint rows) to copy after
    # the pass with `save_states`). `prefills` whole in one pass when no
    # checkpoint falls inside a chunk; the verified chunks last, with keep.
    passes: list = field(default_factory=list)

    def state_views(self, layer_name: str) -> list[torch.Tensor]:
        """The layer's state parts inside `states` (typed views)."""
        return self.buffers.state_views(self.states, layer_name)

    def keep(self, layer_name: str, part: int, value: torch.Tensor) -> None:
        """What a verified chunk leaves for `keep_accepted`: the conv window
        (part 0) or every token's recurrent state (part 1)."""
        self.verify_states.setdefault(layer_name, [None, None])[part] = value


def padded_chunks(chunks, device):
    """A step's chunks (state row, first token row, count) side by side,
    longest first (a stable sort: chunks already in that order keep it), as
    the prefill ops take them: state rows, token rows [chunks, longest]
    (padding repeats a chunk's last token), lengths, and which entries are
    real tokens."""
    chunks = sorted(chunks, key=lambda p: -p[2])
    rows = torch.tensor([row for row, _, _ in chunks], device=device)
    starts = torch.tensor([start for _, start, _ in chunks], device=device)
    lengths = torch.tensor([count for _, _, count in chunks], device=device)
    offsets = torch.arange(int(lengths.max()), device=device)[None, :]
    valid = offsets < lengths[:, None]
    tokens = starts[:, None] + torch.minimum(offsets, lengths[:, None] - 1)
    return rows, tokens, lengths, valid


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


def metadata(inputs: StepInputs, buffers: KVBuffers, read, write, gathered, chunk_rows, saves=()) -> MambaMetadata:
    """What both backends share: the states of table rows `gathered` (their
    read pages) and where they go, the decodes' token rows, the chunks, each
    at its row `chunk_rows[i]` of the gathered states (host), and the
    checkpoints inside them (`saves`: (sequence index, tokens of its chunk
    before the checkpoint, pages)), each a row after the gathered ones."""
    decodes = inputs.decodes
    states, pages = gather(buffers, read[gathered]), write[gathered]
    if saves:
        states = torch.cat([states, states.new_zeros(len(saves), states.shape[1])])
        pages = torch.cat([pages, torch.tensor([list(p) for _, _, p in saves], dtype=pages.dtype,
                                               device=pages.device)])
    meta = MambaMetadata(buffers, states, pages, None if decodes is None else decodes.tokens,
                         0 if decodes is None else decodes.tokens.shape[0])
    if not inputs.fixed_shape:
        meta.prefills, meta.verifies = chunk_lists(inputs.host, chunk_rows)
        meta.passes = prefill_passes(meta.prefills, meta.verifies, inputs.host, chunk_rows, saves,
                                     int(gathered.shape[0]), states.device)
    elif saves:
        raise ValueError("a fixed-shape step has no prefill chunk to save a state inside")
    return meta


def prefill_passes(prefills, verifies, host, chunk_rows, saves, first_save_row: int, device) -> list:
    """`MambaMetadata.passes`: each prefill chunk cut at its checkpoints
    into pieces, pass j running the j-th piece of every chunk that has one
    and then copying the state of each chunk cut at that piece's end to its
    checkpoint's row (checkpoint k's row: first_save_row + k); then the
    verified chunks."""
    passes = [(prefills, False, None)] if prefills else []
    if saves:
        row_of = {int(i): int(r) for r, i in zip(chunk_rows, host.chunks)}
        cuts: dict[int, list[tuple[int, int]]] = {}  # state row -> (offset, checkpoint row), ascending
        for k, (sequence, offset, _) in enumerate(saves):
            row = row_of.get(int(sequence))
            count = int(host.counts[sequence])
            if row is None or not 0 < offset < count or \
                    (host.verifying is not None and host.verifying[sequence]):
                raise ValueError(f"a state saved after {offset} tokens of sequence {sequence}: not inside a "
                                 f"prefill chunk of the step")
            cuts.setdefault(row, []).append((int(offset), first_save_row + k))
        pieces = []  # per chunk: its pieces (state row, first token row, count) and the rows saved after each
        for row, start, count in prefills:
            ends = sorted(cuts.get(row, ()))
            bounds = [0] + [offset for offset, _ in ends] + [count]
            pieces.append([((row, start + a, b - a), ends[j][1] if j < len(ends) else None)
                           for j, (a, b) in enumerate(zip(bounds, bounds[1:]))])
        passes = []
        for j in range(max(len(p) for p in pieces)):
            now = [p[j] for p in pieces if len(p) > j]
            copies = [(chunk[0], save) for chunk, save in now if save is not None]
            passes.append(([chunk for chunk, _ in now], False,
                           (torch.tensor([r for r, _ in copies], device=device),
                            torch.tensor([s for _, s in copies], device=device)) if copies else None))
    if verifies:
        passes.append(([v[:3] for v in verifies], True, None))
    return passes


def finish(meta: MambaMetadata) -> None:
    """Write the gathered states to their write pages."""
    rows = meta.write_pages.shape[0]
    if rows:
        meta.buffers.pool[meta.write_pages] = meta.states.view(rows, meta.write_pages.shape[1], -1)


class GatheredPrefill:
    """The parts of RecurrentOps every backend runs on gathered states:
    the chunked prefill of every kind (the reference scans, side by side),
    `finish`, and the rollback after verified drafts."""

    finish = staticmethod(finish)

    def save_states(self, meta: MambaMetadata, layer_name: str, saves) -> None:
        source, checkpoint = saves
        for part in meta.state_views(layer_name):
            part[checkpoint] = part[source]

    def _conv(self, meta: MambaMetadata, layer_name: str, rows, x, lengths, weight, bias, keep):
        """The causal conv of chunks from the windows of `rows`, before any
        activation; the windows move on."""
        conv_state = meta.state_views(layer_name)[0]
        before = conv_state[rows]
        y, new_conv = causal_conv(x, lengths, before, weight, bias)
        conv_state[rows] = new_conv.to(conv_state.dtype)
        if keep:  # in meta.verifies order (keep_accepted picks one state per chunk)
            meta.keep(layer_name, 0, torch.cat([before.to(x.dtype), x.transpose(1, 2)], 2))
        return y

    def conv_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, lengths, weight, bias, keep=False):
        return F.silu(self._conv(meta, layer_name, rows, x, lengths, weight, bias, keep))

    def _scan(self, meta: MambaMetadata, layer_name: str, rows, scan, inputs, lengths, keep):
        """`scan(*inputs, state, lengths, per_token)` of the kind from the
        recurrent states (part 1) of `rows`, which move on."""
        state = meta.state_views(layer_name)[1]
        y, new_state, per_token = scan(*inputs, state[rows], lengths, per_token=keep)
        state[rows] = new_state.to(state.dtype)
        if keep:
            meta.keep(layer_name, 1, per_token)
        return y

    def ssm_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, lengths, keep=False):
        return self._scan(meta, layer_name, rows, selective_scan, (x, dt, A, B, C), lengths, keep)

    def ssd_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, D, lengths, keep=False):
        return self._scan(meta, layer_name, rows, ssd_scan, (x, dt, A, B, C, D), lengths, keep)

    def gated_delta_prefill(self, meta: MambaMetadata, layer_name: str, rows, q, k, v, g, beta, lengths, keep=False):
        return self._scan(meta, layer_name, rows, gated_delta_scan, (q, k, v, g, beta), lengths, keep)

    def short_conv_prefill(self, meta: MambaMetadata, layer_name: str, rows, b, c, x, lengths, weight, bias,
                           keep=False):
        return c * self._conv(meta, layer_name, rows, b * x, lengths, weight, bias, keep)

    def keep_accepted(self, meta: MambaMetadata, accepted: list[int]) -> None:
        keep_accepted(meta, accepted)


class GatheredSteps:
    """The one-token ops of every kind on gathered states (each decode
    sequence's state is row `meta.step_rows[i]` of `meta.states`): the
    reference's decode, and any backend's for a kind it has no kernel for."""

    def conv_step(self, meta: MambaMetadata, layer_name: str, x, weight, bias):
        return F.silu(self._conv_step(meta, layer_name, x, weight, bias))

    def _conv_step(self, meta, layer_name, x, weight, bias):
        conv_state = meta.state_views(layer_name)[0]
        rows = meta.step_rows
        y, new_state = causal_conv_step(x, conv_state[rows], weight, bias)
        conv_state[rows] = new_state.to(conv_state.dtype)
        return y

    def _step(self, meta: MambaMetadata, layer_name: str, update, *inputs):
        """`update(*inputs, state)` of the kind on the decode rows'
        recurrent states (part 1), which move on."""
        state = meta.state_views(layer_name)[1]
        rows = meta.step_rows
        y, new_state = update(*inputs, state[rows])
        state[rows] = new_state.to(state.dtype)
        return y

    def ssm_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D, gate):
        y = self._step(meta, layer_name, selective_scan_step, x, dt, A, B, C)
        return (y + x.float() * D) * F.silu(gate.float())

    def ssd_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D):
        return self._step(meta, layer_name, ssd_step, x, dt, A, B, C, D)

    def gated_delta_step(self, meta: MambaMetadata, layer_name: str, q, k, v, g, beta):
        return self._step(meta, layer_name, gated_delta_step, q, k, v, g, beta)

    def short_conv_step(self, meta: MambaMetadata, layer_name: str, b, c, x, weight, bias):
        return c * self._conv_step(meta, layer_name, b * x, weight, bias)


class InPlaceRecurrences:
    """Mamba-2's update and the gated delta rule stepped by an
    implementation's kernels on the gathered float32 states in place, decode
    rows and prefill chunks alike (the C and Triton sides). A subclass gives
    `ssd_kernel(state, rows, x, dt, A, B, C, D, lengths)` and
    `gated_delta_kernel(state, rows, q, k, v, g, beta, lengths)` over [R, L,
    ...] inputs from state rows `rows` of `state` (each row contiguous),
    returning float32 outputs, 0 past a length. bfloat16 states, and chunks
    that keep every token's state (verified drafts), go to the next class in
    line (the reference's gathered ops)."""

    @staticmethod
    def _in_place(state: torch.Tensor) -> bool:
        return state.dtype == torch.float32 and state[0].is_contiguous()

    def ssd_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D):
        state = meta.state_views(layer_name)[1]
        if not self._in_place(state):
            return super().ssd_step(meta, layer_name, x, dt, A, B, C, D)
        ones = torch.ones(x.shape[0], dtype=torch.int64, device=x.device)
        return self.ssd_kernel(state, meta.step_rows, x[:, None], dt[:, None], A, B[:, None], C[:, None], D,
                               ones)[:, 0]

    def ssd_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, D, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not self._in_place(state):
            return super().ssd_prefill(meta, layer_name, rows, x, dt, A, B, C, D, lengths, keep)
        return self.ssd_kernel(state, rows, x, dt, A, B, C, D, lengths)

    def gated_delta_step(self, meta: MambaMetadata, layer_name: str, q, k, v, g, beta):
        state = meta.state_views(layer_name)[1]
        if not self._in_place(state):
            return super().gated_delta_step(meta, layer_name, q, k, v, g, beta)
        ones = torch.ones(q.shape[0], dtype=torch.int64, device=q.device)
        return self.gated_delta_kernel(state, meta.step_rows, q[:, None], k[:, None], v[:, None], g[:, None],
                                       beta[:, None], ones)[:, 0]

    def gated_delta_prefill(self, meta: MambaMetadata, layer_name: str, rows, q, k, v, g, beta, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not self._in_place(state):
            return super().gated_delta_prefill(meta, layer_name, rows, q, k, v, g, beta, lengths, keep)
        return self.gated_delta_kernel(state, rows, q, k, v, g, beta, lengths)


def keep_accepted(meta: MambaMetadata, accepted: list[int]) -> None:
    """After verification (one count per `meta.verifies` entry: the drafts
    kept): write the state after each sequence's last kept token to its write
    pages, over the state after its last draft that the pass left there.
    From what the layers kept: the conv window, of which the state after
    token j is the K-1 inputs ending at j, and where the kind has one, the
    recurrent state after each token."""
    redo = [(j, a) for j, (v, a) in enumerate(zip(meta.verifies, accepted)) if a < v.count - 1]
    if not redo:
        return  # every draft kept: the pass's final state is the one
    device = meta.states.device
    index = torch.tensor([j for j, _ in redo], device=device)
    kept = torch.tensor([a for _, a in redo], device=device)
    rows = torch.tensor([meta.verifies[j].row for j, _ in redo], device=device)
    states = meta.states[rows]  # a copy: every layer's parts, patched below
    for layer_name, (window, per_token) in meta.verify_states.items():
        parts = meta.buffers.state_views(states, layer_name)
        conv = parts[0]
        width = conv.shape[-1]
        w = window[index]  # [r, I, K-1 + L]: the conv state before the chunk, then its inputs
        at = (kept[:, None] + 1 + torch.arange(width, device=device))[:, None, :].expand(-1, w.shape[1], -1)
        conv.copy_(w.gather(2, at))
        if per_token is not None:
            parts[1].copy_(per_token[index, kept])
    pages = meta.write_pages[rows]
    meta.buffers.pool[pages] = states.view(len(redo), pages.shape[1], -1)
