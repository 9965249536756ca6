"""Quantized KV pages: a layer's K and V rows stored as 8-bit codes with one
float32 scale per token and head (value = code * scale), the scales in the
same page as the codes, after them (core/specs.py `code_bytes`).

The scale of a row is its largest magnitude over the type's largest code
(core/dtypes.py QUANTIZED_KV_MAX: 127 for int8, 448 for float8_e4m3fn,
57344 for float8_e5m2), so no element saturates and the largest one is
exact; int8 rounds to the nearest code (ties to even, as torch.round),
float8 as torch converts (to nearest even). A row of zeros has scale 0 and
codes 0. Error per element: int8 at most half a step, amax / 254; e4m3 at
most 2^-4 of the element's own magnitude (3 mantissa bits), e5m2 2^-3.

Quantizing happens once, where a page is written (`store`); every read
widens codes times scales to the query's dtype before the products.

int8 pages of a head whose width is a power of two hold their rows
rotated: K and V times the orthonormal Hadamard matrix H of that order,
before quantizing (`rotation`). One large element of a row then spreads
over all of them, so the row's scale no longer leaves the others a few
codes; queries are rotated alike and the attention output rotated back
(H is symmetric and its own inverse), which leaves every product as it
was. On the real Gemma-3 270M this halves int8's error (docs/kv_dtypes.md);
float8 keeps its rows as they are (a float format's error is relative to
each element, and rotated rows measured worse).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.dtypes import QUANTIZED_KV_MAX


@dataclass(frozen=True)
class QuantizedCache:
    """A quantized layer's view of the pool: `codes` [pages, 2 (K, V),
    block_size, kv_heads, head_dim] (int8 or a float8 type) and `scales`
    [pages, 2, block_size, kv_heads] (float32)."""

    codes: torch.Tensor
    scales: torch.Tensor
    # Whether an attention over these pages still has to rotate its queries
    # and output (`rotation`); False in the view an implementation reads
    # once it has (`unrotated`).
    rotate: bool = True

    @property
    def rotation(self) -> torch.Tensor | None:
        return rotation(self.codes.dtype, self.codes.shape[-1], self.codes.device) if self.rotate else None

    def unrotated(self) -> "QuantizedCache":
        return QuantizedCache(self.codes, self.scales, rotate=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.codes.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


_ROTATIONS: dict = {}


def rotation(codes: torch.dtype, dim: int, device) -> torch.Tensor | None:
    """The float32 orthonormal Hadamard matrix (Sylvester's order) that
    pages of `codes` with rows of `dim` elements are rotated by, or None
    (float8 codes, or a width that is no power of two)."""
    if codes != torch.int8 or dim & (dim - 1):
        return None
    key = (dim, str(device))
    if key not in _ROTATIONS:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _ROTATIONS[key] = (h / dim ** 0.5).to(device)
    return _ROTATIONS[key]


def rotated(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x [..., dim] times h, in x's dtype (computed in float32)."""
    return (x.float() @ h).to(x.dtype)


def code_max(dtype: torch.dtype) -> float:
    return QUANTIZED_KV_MAX[str(dtype).removeprefix("torch.")]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] of `dtype`, scales [...]
    float32), each row scaled by its own largest magnitude."""
    x = x.float()
    scales = x.abs().amax(dim=-1) / code_max(dtype)
    top = code_max(dtype)
    # clamped: the largest element's quotient may round a hair past the top code
    scaled = (x / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)).clamp_(-top, top)
    if dtype == torch.int8:
        return scaled.round_().to(torch.int8), scales
    return scaled.to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] times scales [...] in `dtype` (computed in float32)."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)
