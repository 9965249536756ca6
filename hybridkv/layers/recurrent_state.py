"""Where a recurrent layer's per-request state lives during a step, and
each recurrent kind's metadata (one class per kind, over the small
`RecurrentMetadata` every kind shares), which an implementation's ops for
that kind build and the kind's mixer hands back to them
(backends/base.py: `MambaOps`, `Mamba2Ops`, `GatedDeltaOps`,
`ShortConvOps`). The reference gathers every sequence's state from the
pool into one tensor and scatters them back after the forward (`finish`);
the Triton kernels update Mamba-1's decode states in the pool in place,
from their read pages to their write pages. Prefill chunks run on
gathered states in every implementation.

A state is parts (the spec's shapes): part 0 is the causal conv's window
for every kind here (the K-1 inputs before the next token), part 1 the
recurrent state where the kind has one (Mamba-1 [I, N], Mamba-2 [H, P, N],
Gated DeltaNet [Hv, K, V]; the short conv has none).

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

from .kv_buffers import KVBuffers
from .step import StepInputs


class Verified(NamedTuple):
    row: int  # state row
    start: int  # first token row
    count: int  # the sampled token and the drafts
    sequence: int  # index of the sequence in the step


@dataclass
class RecurrentMetadata:
    """What every recurrent kind's metadata holds: the step's gathered
    states, where they go, the decodes and the chunks, and the conv window
    each verified chunk leaves."""

    buffers: KVBuffers
    states: torch.Tensor  # [R, state bytes] gathered states (rows: see the backends)
    write_pages: torch.Tensor  # [R, pages per block] where those rows go after the step
    step_tokens: torch.Tensor | None  # token rows of the sequences with one token this step
    num_steps: int  # how many: the layers skip the step ops at 0
    step_rows: torch.Tensor | None = None  # gathered decodes: their rows of `states`
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (state row, first token row, count)
    # Sequences verifying drafts: chunks like prefills, but the layers keep
    # what `keep_accepted` needs to go back to any of their tokens.
    verifies: list["Verified"] = field(default_factory=list)
    # layer name -> [verified chunks, channels, K-1 + L]: the conv window
    # before each verified chunk, then the chunk's inputs
    windows: dict = field(default_factory=dict)
    # What the layers' prefill ops run, pass after pass: (chunks as
    # `prefills`, keep, None or (state rows, checkpoint rows) to copy after
    # the pass with `save_states`). `prefills` whole in one pass when no
    # checkpoint falls inside a chunk; the verified chunks last, with keep.
    passes: list = field(default_factory=list)

    def state_views(self, layer_name: str) -> list[torch.Tensor]:
        """The layer's state parts inside `states` (typed views)."""
        return self.buffers.state_views(self.states, layer_name)


@dataclass
class MambaMetadata(RecurrentMetadata):
    """Mamba-1's (Jamba): its decodes' pages where kernels step their
    states in the pool, and its recurrent state after each verified token."""

    step_pages: tuple | None = None  # kernels: the decodes' (read, write, zero) pages in the pool
    token_states: dict = field(default_factory=dict)  # layer name -> [verified chunks, L, I, N]


@dataclass
class Mamba2Metadata(RecurrentMetadata):
    """Mamba-2's (SSD): its recurrent state after each verified token."""

    token_states: dict = field(default_factory=dict)  # layer name -> [verified chunks, L, H, P, N]


@dataclass
class GatedDeltaMetadata(RecurrentMetadata):
    """Gated DeltaNet's: its recurrent state after each verified token."""

    token_states: dict = field(default_factory=dict)  # layer name -> [verified chunks, L, Hv, K, V]


@dataclass
class ShortConvMetadata(RecurrentMetadata):
    """The gated short conv's (LFM2): its state is the conv window alone,
    so the common part is all it needs."""


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


def metadata(kind_metadata: type, inputs: StepInputs, buffers: KVBuffers, read, write, gathered, chunk_rows,
             saves=()) -> RecurrentMetadata:
    """A `kind_metadata` (a kind's metadata class) as every implementation
    builds it: the states of table rows `gathered` (their
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
    meta = kind_metadata(buffers, states, pages, None if decodes is None else decodes.tokens,
                         0 if decodes is None else decodes.tokens.shape[0])
    if not inputs.fixed_shape:
        meta.prefills, meta.verifies = chunk_lists(inputs.host, chunk_rows)
        meta.passes = prefill_passes(meta.prefills, meta.verifies, inputs.host, chunk_rows, saves,
                                     int(gathered.shape[0]), states.device)
    elif saves:
        raise ValueError("a fixed-shape step has no prefill chunk to save a state inside")
    return meta


def prefill_passes(prefills, verifies, host, chunk_rows, saves, first_save_row: int, device) -> list:
    """`RecurrentMetadata.passes`: each prefill chunk cut at its checkpoints
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


def finish(meta: RecurrentMetadata) -> None:
    """Write the gathered states to their write pages."""
    rows = meta.write_pages.shape[0]
    if rows:
        meta.buffers.pool[meta.write_pages] = meta.states.view(rows, meta.write_pages.shape[1], -1)


def keep_accepted(meta: RecurrentMetadata, accepted: list[int], token_states: dict | None = None) -> None:
    """After verification (one count per `meta.verifies` entry: the drafts
    kept): write the state after each sequence's last kept token to its write
    pages, over the state after its last draft that the pass left there.
    From what the layers kept: the conv window (`meta.windows`), of which
    the state after token j is the K-1 inputs ending at j, and where the
    kind has one, the recurrent state after each token (`token_states`, the
    kind's metadata's)."""
    redo = [(j, a) for j, (v, a) in enumerate(zip(meta.verifies, accepted)) if a < v.count - 1]
    if not redo:
        return  # every draft kept: the pass's final state is the one
    device = meta.states.device
    index = torch.tensor([j for j, _ in redo], device=device)
    kept = torch.tensor([a for _, a in redo], device=device)
    rows = torch.tensor([meta.verifies[j].row for j, _ in redo], device=device)
    states = meta.states[rows]  # a copy: every layer's parts, patched below
    for layer_name, window in meta.windows.items():
        parts = meta.buffers.state_views(states, layer_name)
        conv = parts[0]
        width = conv.shape[-1]
        w = window[index]  # [r, I, K-1 + L]: the conv state before the chunk, then its inputs
        at = (kept[:, None] + 1 + torch.arange(width, device=device))[:, None, :].expand(-1, w.shape[1], -1)
        conv.copy_(w.gather(2, at))
        if token_states is not None:
            parts[1].copy_(token_states[layer_name][index, kept])
    pages = meta.write_pages[rows]
    meta.buffers.pool[pages] = states.view(len(redo), pages.shape[1], -1)
