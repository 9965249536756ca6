"""The shared modules the cpu backend runs its own way, swapped in by
`CpuBackend.prepare` (each a subclass with the same parameters):

* `CpuRMSNorm`: the RMS norm, and Gemma's q/k norm followed by the rotary
  rotation, in one C pass each (kernels.c `norm_rotary`), where torch's
  composite norm alone makes five passes;
* `CpuGatedMLP`: the gated MLP's `act(gate) * up` in one pass
  (`gated_activation`; SiLU, or GELU's tanh form).

Each call checks its tensor (float32, on the CPU, not being traced by
torch.compile) and otherwise runs the shared module's torch code. Results
equal torch's to float32 rounding (the order of the sums differs).
"""

from __future__ import annotations

import torch
from torch import nn

from ...mlp import GatedMLP
from ...norm import RMSNorm
from ..swap import swap_norms_and_mlps as swap_for_twins

# GatedMLP activations the C side computes: SiLU, and GELU's tanh form.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def norm_rotary(lib, x: torch.Tensor, weight: torch.Tensor | None, offset: float, eps: float,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., dim]: each row scaled by rsqrt(mean(x^2) + eps) * (weight +
    offset) where `weight` is given, then rotated (rotate-half) by cos, sin
    [x.shape[0], dim] where given (x then [tokens, heads, dim]). A new
    contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    view = x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1])
    outer, inner, dim = view.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    lib.norm_rotary(view.data_ptr(), outer, inner, dim, view.stride(0), view.stride(1),
                    None if weight is None else weight.data_ptr(), offset, eps,
                    None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                    out.data_ptr(), torch.get_num_threads())
    return out


def gated_activation(lib, gate_up: torch.Tensor, kind: int) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (the gate's columns, then up's) -> act(gate) * up."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.gated_activation(gate_up.data_ptr(), rows, inter, gate_up.stride(0), kind, out.data_ptr(),
                         torch.get_num_threads())
    return out


class CpuRMSNorm(RMSNorm):
    lib = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if usable(x):
            return norm_rotary(self.lib, x, self.weight, 1.0 if self.unit_offset else 0.0, self.eps)
        return super().forward(x)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and usable(x):
            return norm_rotary(self.lib, x, self.weight, 1.0 if self.unit_offset else 0.0, self.eps, cos, sin)
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
