"""Quantized KV pages: a layer's K and V rows stored as 8-bit codes with one
float32 scale per token and head (value = code * scale), the scales in the
same page as the codes, after them (core/specs.py `code_bytes`), or, where
the layout keeps a group's scales apart (core/layout.py `scales_apart`), in
pages of their own of the same block.

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

int8 keys are stored less their layer's centre (`KeyCentre`): a constant
vector per layer and KV head, the mean key over a calibration text. A
query's scores over keys k - c are its scores over k less the same q.c
for every key, and softmax does not see a constant added to all its
inputs, so attention reads the pages as they are, without adding c back.
What changes is the rounding: the keys of a layer share a large offset in
a few dimensions (the same in every row), which sets each row's scale
and leaves the part that differs between keys a few codes; less their
centre, the rows keep the argmax of float pages at 99% of positions where
int8 rows alone keep 98.4% (docs/kv_dtypes.md). This holds only where
nothing but softmax sees the scores: a layer that caps its scores (tanh)
or compares them with a sink's logit keeps its keys as they are; so do
float8 pages (engine/key_centres.py says why).
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
    # The page column of the block whose table gives the scales' pages,
    # where they lie apart from the codes; None: the codes' own pages.
    scale_column: int | None = None

    def scales_at(self, column: int) -> int:
        """The table column of the scales of pages read through `column`."""
        return column if self.scale_column is None else self.scale_column

    @property
    def rotation(self) -> torch.Tensor | None:
        return rotation(self.codes.dtype, self.codes.shape[-1], self.codes.device) if self.rotate else None

    def unrotated(self) -> "QuantizedCache":
        return QuantizedCache(self.codes, self.scales, rotate=False, scale_column=self.scale_column)

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


class KeyCentre:
    """A layer's key centre: `values` [kv_heads, head_dim] float32, zero
    until measured. Calling it on a step's new keys [tokens, kv_heads,
    head_dim] gives them less the centre, in float32 (the store rounds them
    once, to codes).

    `measure(n)`: the next n keys it sees are summed (and stored as they
    are: the centre is still zero), and their mean, rounded to bfloat16 (so
    that machines whose float32 keys differ in the last bits still agree on
    it), becomes the centre. The engine measures over one calibration
    prompt before it serves anything (engine/key_centres.py); every
    tensor-parallel rank counts the same keys for its own heads, so no rank
    needs another's word on when the measurement ends. The values change
    in place: a captured step reads them as they are."""

    def __init__(self, kv_heads: int, head_dim: int, device):
        self.values = torch.zeros(kv_heads, head_dim, dtype=torch.float32, device=device)
        self._left = 0  # keys still to measure
        self._seen = 0
        self._sum: torch.Tensor | None = None

    def measure(self, tokens: int) -> None:
        if tokens <= 0:
            raise ValueError(f"a key centre is measured over at least one key, not {tokens}")
        self.values.zero_()
        self._left, self._seen, self._sum = tokens, 0, torch.zeros(self.values.shape, dtype=torch.float64)

    @property
    def measuring(self) -> bool:
        return self._left > 0

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        if self._left:
            if k.shape[0] > self._left:
                raise RuntimeError(f"a key centre measuring {self._left} more keys was given {k.shape[0]}: "
                                   f"something other than the calibration prompt ran while it measured")
            self._sum += k.detach().double().sum(0).cpu()
            self._seen += k.shape[0]
            self._left -= k.shape[0]
            if not self._left:
                self.values.copy_((self._sum / self._seen).to(torch.bfloat16).float())
                self._sum = None
        return k.float() - self.values


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
