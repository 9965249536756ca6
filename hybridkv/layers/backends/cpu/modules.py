"""The shared modules the cpu backend runs its own way, swapped in by
`CpuBackend.prepare` (each a subclass with the same parameters):

* `CpuRMSNorm`: the RMS norm, and Gemma's q/k norm followed by the rotary
  rotation, in one C pass each (kernels.c `norm_rotary`), where torch's
  composite norm alone makes five passes;
* `CpuGatedMLP`: the gated MLP's `act(gate) * up` in one pass
  (`gated_activation`; SiLU, or GELU's tanh form).

Each call checks its tensor (float32 or bfloat16, on the CPU, not being
traced by torch.compile) and otherwise runs the shared module's torch code
(the prepare report names a model dtype the kernels do not read). In
float32 results equal torch's to float32 rounding (the order of the sums
differs); in bfloat16 the kernels compute in float32 and round where
torch's modules round, so results equal torch's but where a float32
rounding apart falls on the other side of a bfloat16 one (1 ulp).
"""

from __future__ import annotations

import torch
from torch import nn

from ...mlp import GatedMLP
from ...norm import RMSNorm
from ..swap import swap_norms_and_mlps as swap_for_twins
from .attention import STORAGE

# GatedMLP activations the C side computes: SiLU, and GELU's tanh form.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def usable(x: torch.Tensor) -> bool:
    return x.dtype in STORAGE and x.device.type == "cpu" and not torch.compiler.is_compiling()


def norm_rotary(lib, x: torch.Tensor, weight: torch.Tensor | None, offset: float, eps: float,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                round_first: bool = False) -> torch.Tensor:
    """x [..., dim]: each row scaled by rsqrt(mean(x^2) + eps) * (weight +
    offset) where `weight` is given (`round_first`: the norm rounded to x's
    dtype before the weight scales it), then rotated (rotate-half) by cos,
    sin [x.shape[0], dim] where given (x then [tokens, heads, dim]). x, cos
    and sin of one dtype, the weight of its own (both in `STORAGE`). A new
    contiguous tensor of x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    view = x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])
    outer, inner, dim = view.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    lib.norm_rotary(view.data_ptr(), outer, inner, dim, view.stride(0), view.stride(1),
                    None if weight is None else weight.data_ptr(), 0 if weight is None else STORAGE[weight.dtype],
                    offset, eps, round_first, None if cos is None else cos.data_ptr(),
                    None if sin is None else sin.data_ptr(), out.data_ptr(), STORAGE[x.dtype],
                    torch.get_num_threads())
    return out


def gated_activation(lib, gate_up: torch.Tensor, kind: int) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (the gate's columns, then up's) -> act(gate) * up."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.gated_activation(gate_up.data_ptr(), rows, inter, gate_up.stride(0), kind, out.data_ptr(),
                         STORAGE[gate_up.dtype], torch.get_num_threads())
    return out


class CpuRMSNorm(RMSNorm):
    lib = None

    def _usable(self, x: torch.Tensor) -> bool:
        # Llama's convention scales in the wider of the two dtypes (RMSNorm.forward): x's only.
        return usable(x) and self.weight.dtype in STORAGE and (
            self.unit_offset or self.scale_in_float32 or torch.promote_types(self.weight.dtype, x.dtype) == x.dtype)

    def _run(self, x, cos=None, sin=None):
        # Gemma's (1 + w) and a float32 scale apply before the cast back; Llama's w after it.
        return norm_rotary(self.lib, x, self.weight, 1.0 if self.unit_offset else 0.0, self.eps, cos, sin,
                           round_first=not (self.unit_offset or self.scale_in_float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x) if self._usable(x) else super().forward(x)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Whole heads rotated, cos and sin of x's dtype (else torch's product widens).
        if x.dim() == 3 and cos.shape[-1] == x.shape[-1] and cos.dtype == sin.dtype == x.dtype and self._usable(x):
            return self._run(x, cos, sin)
        return super().rotated(x, cos, sin)


class CpuGatedMLP(GatedMLP):
    lib = None

    def activated(self, x):
        if x.dim() == 2 and usable(x):
            return gated_activation(self.lib, self.gate_up_proj(x), ACTIVATIONS[self.kind])
        return super().activated(x)


def swap_norms_and_mlps(model: nn.Module, lib) -> tuple[int, int]:
    """(norms, MLPs) swapped for their C-backed twins (swap.py's rule)."""
    return swap_for_twins(model, CpuRMSNorm, CpuGatedMLP, ACTIVATIONS, lib=lib)
