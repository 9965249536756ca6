"""RMSNorm in the conventions the supported families use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .rotary import apply_rotary


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps)` computed in float32, then scaled.

    unit_offset=True is Gemma's `(1 + w)` scale applied before casting back;
    unit_offset=False is Llama/Jamba's `w * x` applied after casting back,
    or before where `scale_in_float32` (gpt-oss, whose norm weights
    transformers keeps in float32). In float32 all orders agree.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False, scale_in_float32: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.scale_in_float32 = scale_in_float32
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return F.rms_norm(x.float(), x.shape[-1:], 1.0 + self.weight.float(), self.eps).type_as(x)
        if self.scale_in_float32:
            return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).type_as(x)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The norm of x [tokens, heads, dim], then rotary embeddings
        (layers/rotary.py); a backend may do both in one pass."""
        return apply_rotary(self(x), cos, sin)
