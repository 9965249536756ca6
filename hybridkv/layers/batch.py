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
    runner writes them back to the pages the manager chose.

    With the Triton kernels (layers/backend.py) the decode requests' states
    are not gathered: the kernels update them in the pool, from their read
    pages to their write pages (`decode_pages`), and `states` holds the
    prefill requests' rows only."""

    states: torch.Tensor
    decode_rows: torch.Tensor  # rows of `states` of requests with one new token
    decode_tokens: torch.Tensor  # their token rows in the step
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (row, first token, count)
    # Kernel path: (read pages, write pages [requests, pages per block],
    # zero [requests]: no state yet) of the decode requests, in token order.
    decode_pages: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    buffers: KVBuffers
    attention: dict[int, AttentionMetadata] = field(default_factory=dict)
    mamba: dict[int, MambaBatch] = field(default_factory=dict)
