"""Elementwise work in one C pass on the CPU (cpu_kernels.c): RMS norms,
Gemma's q/k norms with the rotary rotation after them, and the gated MLP's
activation times its up projection. In torch each is a chain of ops, each
reading and writing the whole tensor (a norm: square, mean, add, root,
two products); on a 1,024-token prefill step of the real Gemma-3 270M they
were ~15% of the step (docs/engine.md, "Where the time goes").

`configure(model, lib)` binds the library to the model's norms and MLPs
when the engine runs the "cpu" backend (layers/backend.py); each call then
checks its tensor (float32, on the CPU, not being traced by torch.compile)
and otherwise runs the module's torch code. Results equal torch's to
float32 rounding (the order of the sums differs).
"""

from __future__ import annotations

import torch
from torch import nn

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


def configure(model: nn.Module, lib) -> int:
    """Bind `lib` to every module that can use it; returns how many."""
    count = 0
    for module in model.modules():
        bind = getattr(module, "bind_native", None)
        if bind is not None and bind(lib):
            count += 1
    return count
