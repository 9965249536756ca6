"""What one forward pass carries besides the weights.

`StepInputs` are the facts of a step, as device tensors the worker fills
(from its preallocated buffers for a decode step): the tokens, their
positions, each scheduled sequence's row in the persistent block tables, and
the step's split, made once here for every backend and group: the sequences
with one token (`Decodes`) and those with several (`Chunks`: prefill chunks,
drafts to verify). Each attention group adds, once per step, where its new
K/V goes and which keys each query reads (`AttentionStep`). The backend turns
these into its own per-group metadata (`StepBatch.attention[group]`,
`StepBatch.recurrent[group]`), which the layers hand back to the backend's
ops, and names the step's route (`StepBatch.route`, with what that route
reads in `route_state`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


def capturing(x: torch.Tensor) -> bool:
    """Is this forward being traced (torch.compile) or captured (a CUDA
    graph)? Then an op must not make shapes from data (a sync, and a shape
    the replay would not follow); eagerly it may, where that is cheaper."""
    if torch.compiler.is_compiling():
        return True
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass
class HostStep:
    """numpy copies of the step's layout, for eager metadata (prefill
    segments, the narrowing of decode reads)."""

    positions: np.ndarray  # [T]
    starts: np.ndarray  # [S] first token row of each sequence
    counts: np.ndarray  # [S] tokens of each sequence in this step
    table_rows: np.ndarray  # [S] as StepInputs.table_rows
    decodes: np.ndarray  # indices of the sequences with one token
    chunks: np.ndarray  # indices of the sequences with several
    verifying: np.ndarray | None = None  # [S] bool: the sequence verifies draft tokens (speculative decoding)


@dataclass
class Decodes:
    """The sequences with one token in this step: attended in one batch,
    their Mamba states updated by one step op."""

    tokens: torch.Tensor  # [D] their token rows
    seqs: torch.Tensor  # [D] their indices among the step's sequences
    table_rows: torch.Tensor  # [D] their rows of the persistent tables


@dataclass
class Chunks:
    """The sequences with several tokens in this step (prefill chunks,
    drafts to verify), as the kernels take them."""

    starts: torch.Tensor  # [C] first token row of each
    lengths: torch.Tensor  # [C]
    table_rows: torch.Tensor  # [C]
    longest: int  # sizes a kernel grid with no device sync


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    table_rows: torch.Tensor  # [S] each sequence's row of the persistent tables
    token_table_rows: torch.Tensor  # [T] the table row of each token's sequence
    decodes: Decodes | None
    chunks: Chunks | None = None
    host: HostStep | None = None  # None: a fixed-shape step

    @property
    def fixed_shape(self) -> bool:
        """A fixed-shape step: every sequence has exactly one token, token t
        is sequence t's, and the batch is padded to a bucket. Its metadata
        comes from device tensors alone, so nothing in the forward reads a
        host value or makes a shape from data: the step can be traced
        (torch.compile) or captured as a CUDA graph."""
        return self.host is None

    @classmethod
    def fixed(cls, input_ids: torch.Tensor, positions: torch.Tensor, table_rows: torch.Tensor,
              order: torch.Tensor) -> "StepInputs":
        """A fixed-shape step (see `fixed_shape`); `order` is arange(len(input_ids)),
        passed in so that a captured step reads a preallocated buffer."""
        # Token t is sequence t's: its table row is table_rows[t], its row order[t] = t.
        return cls(input_ids, positions, table_rows, table_rows, Decodes(order, order, table_rows))

    @classmethod
    def from_host(cls, input_ids: np.ndarray, first_positions: np.ndarray, counts: np.ndarray,
                  table_rows: np.ndarray, device, verifying: np.ndarray | None = None) -> "StepInputs":
        """An eager step: sequence i has `counts[i]` tokens from position
        `first_positions[i]` (its tokens `input_ids`, concatenated in
        order); one host-to-device copy for all of it. `verifying[i]`: its
        last tokens are drafts to verify (Mamba layers then keep the state
        after each of its tokens)."""
        counts = np.asarray(counts, dtype=np.int64)
        starts = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        seq_of_token = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(len(seq_of_token)) - starts[seq_of_token] + \
            np.asarray(first_positions, dtype=np.int64)[seq_of_token]
        table_rows = np.asarray(table_rows, dtype=np.int64)
        decodes, chunks = np.nonzero(counts == 1)[0], np.nonzero(counts > 1)[0]
        host = HostStep(positions, starts, counts, table_rows, decodes, chunks, verifying)
        staged = [np.asarray(input_ids, dtype=np.int64), positions, table_rows, table_rows[seq_of_token],
                  starts[decodes], decodes, table_rows[decodes], starts[chunks], counts[chunks], table_rows[chunks]]
        (ids, pos, rows, token_rows, d_tokens, d_seqs, d_rows, c_starts, c_lengths, c_rows) = \
            torch.from_numpy(np.concatenate(staged)).to(device).split([len(a) for a in staged])
        return cls(ids, pos, rows, token_rows, Decodes(d_tokens, d_seqs, d_rows) if decodes.size else None,
                   Chunks(c_starts, c_lengths, c_rows, int(counts[chunks].max())) if chunks.size else None, host)


@dataclass
class AttentionStep:
    """One attention group's part of a step, the same for every backend:
    where each new token's K/V goes and the first key each query reads.
    Built once per group per step (`attention_step`)."""

    inputs: StepInputs
    spec: object
    table: torch.Tensor  # [width, table rows, max_blocks] the group's persistent tables, from key position 0
    block_size: int
    store_pages: torch.Tensor  # [width, T] page of each new token's block, per column
    store_offsets: torch.Tensor  # [T] its slot within the block
    first_key: torch.Tensor  # [T] spec.first_visible(position): a query reads keys first_key .. position


def attention_step(inputs: StepInputs, table: torch.Tensor, spec, block_size: int) -> AttentionStep:
    pos = inputs.positions
    return AttentionStep(inputs, spec, table, block_size, table[:, inputs.token_table_rows, pos // block_size],
                         pos % block_size, spec.first_visible(pos))


@dataclass
class StepBatch:
    inputs: StepInputs
    buffers: object  # the KV buffers (kv_buffers.KVBuffers): the pool the layers' caches view
    attention: dict[int, object] = field(default_factory=dict)  # group -> the backend's attention metadata
    recurrent: dict[int, object] = field(default_factory=dict)  # group -> its kind's metadata (recurrent_state.py)
    route: str = ""  # how the step runs (Backend.route), counted by the worker
    route_state: object = None  # what that route reads, where it needs more than the metadata

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs.positions
