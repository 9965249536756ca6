"""What one forward pass carries besides the weights: the tokens, their
positions, and per KV cache group how to reach the cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_buffers import KVBuffers
from .paged_attention import AttentionMetadata


@dataclass
class MambaBatch:
    """The recurrent states of one Mamba group for this step, gathered into
    `states` ([requests, state bytes]); layers update them in place and the
    runner writes them back to the pages the manager chose."""

    states: torch.Tensor
    decode_rows: torch.Tensor  # rows of requests with one new token
    decode_tokens: torch.Tensor  # their token rows in the step
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first token, count)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    buffers: KVBuffers
    attention: dict[int, AttentionMetadata] = field(default_factory=dict)
    mamba: dict[int, MambaBatch] = field(default_factory=dict)
