"""Swapping a loaded model's shared modules for a backend's twins: a
subclass holding the same tensors that runs some of the work its own way
(`Backend.prepare` does this; backends/cpu/modules.py and
backends/triton/modules.py have the twins)."""

from __future__ import annotations

from torch import nn

from ..mlp import GatedMLP
from ..norm import RMSNorm


def twin(cls, module: nn.Module, **extra) -> nn.Module:
    """A `cls` (a subclass of `module`'s class) holding `module`'s
    parameters, buffers, submodules and attributes (the same tensors)."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for key, value in vars(module).items():
        vars(new)[key] = dict(value) if key in ("_parameters", "_buffers", "_modules") else value
    vars(new).update(extra)
    return new


def replace(model: nn.Module, kind: type, make) -> int:
    """Every submodule of exactly type `kind` replaced by `make(module)`
    (where that gives one); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                new = make(child)
                if new is not None:
                    setattr(parent, name, new)
                    count += 1
    return count


def swap_norms_and_mlps(model: nn.Module, norm_twin: type, mlp_twin: type, activations, **extra) -> tuple[int, int]:
    """(norms, MLPs) of `model` swapped for a backend's twins (`extra`: what
    the twins run with). An MLP whose gate and up are not fused, or whose
    activation is not in `activations`, keeps torch's."""
    norms = replace(model, RMSNorm, lambda m: twin(norm_twin, m, **extra))
    mlps = replace(model, GatedMLP, lambda m: twin(mlp_twin, m, **extra)
                   if m.gate_up_proj is not None and m.kind in activations else None)
    return norms, mlps
