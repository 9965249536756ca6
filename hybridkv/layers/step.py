"""What one forward pass carries besides the weights.

`StepInputs` are the facts of a step, as device tensors the runner fills
(from its preallocated buffers for a decode step): the tokens, their
positions, and for each scheduled sequence its row in the persistent block
tables and its tokens. The backend turns them into its own per-group
metadata once per step (`StepBatch.attention[group]`, `StepBatch.mamba[group]`),
which the layers hand back to the backend's ops.

A decode step at fixed shapes has one token per sequence, in sequence
order, padded to a bucket: then `host` is None, nothing in the forward
reads a host value, and the step can be captured as a CUDA graph.
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
    slot_rows: np.ndarray  # [S] as StepInputs.slot_rows
    verifying: np.ndarray | None = None  # [S] bool: the sequence verifies draft tokens (speculative decoding)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_rows: torch.Tensor  # [S] each sequence's row of the persistent tables
    seq_of_token: torch.Tensor  # [T] which sequence each token belongs to
    host: HostStep | None = None  # None: a fixed-shape decode step (one token per sequence)

    @classmethod
    def from_host(cls, input_ids: np.ndarray, first_positions: np.ndarray, counts: np.ndarray,
                  slot_rows: np.ndarray, device, verifying: np.ndarray | None = None) -> "StepInputs":
        """An eager step: sequence i has `counts[i]` tokens from position
        `first_positions[i]` (its tokens `input_ids`, concatenated in
        order); one host-to-device copy for all of it. `verifying[i]`: its
        last tokens are drafts to verify (Mamba layers then keep the state
        after each of its tokens)."""
        counts = np.asarray(counts, dtype=np.int64)
        starts = np.zeros(len(counts), dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        total = int(counts.sum())
        seq_of_token = np.repeat(np.arange(len(counts)), counts)
        positions = np.arange(total) - starts[seq_of_token] + np.asarray(first_positions, dtype=np.int64)[seq_of_token]
        slot_rows = np.asarray(slot_rows, dtype=np.int64)
        staged = torch.from_numpy(np.concatenate([np.asarray(input_ids, dtype=np.int64), positions, seq_of_token,
                                                  slot_rows])).to(device)
        return cls(staged[:total], staged[total:2 * total], staged[3 * total:], staged[2 * total:3 * total],
                   HostStep(positions, starts, counts, slot_rows, verifying))


@dataclass
class StepBatch:
    inputs: StepInputs
    buffers: object  # the KV buffers (kv_buffers.KVBuffers): the pool the layers' caches view
    attention: dict[int, object] = field(default_factory=dict)  # group -> the backend's attention metadata
    mamba: dict[int, object] = field(default_factory=dict)  # group -> the backend's Mamba metadata

    @property
    def input_ids(self) -> torch.Tensor:
        return self.inputs.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self.inputs.positions
