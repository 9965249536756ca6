"""Swapping a loaded model's shared modules for a backend's twins: a
subclass holding the same tensors that runs some of the work its own way
(`Backend.prepare` does this; backends/cpu/modules.py and
backends/triton/modules.py have the twins)."""

from __future__ import annotations

from torch import nn


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
