"""The backends: one package per implementation of a step's ops, each behind
the contract of base.py, chosen once when the engine starts.

    backend = choose("auto", device)

| choice | on CUDA | on the CPU |
|---|---|---|
| "auto" (default) | "triton" where triton imports and its kernels pass a self-test there, else "torch" | "cpu" where its C kernels are built for this machine and pass their self-test, else "torch" (with a warning saying why) |
| "torch" | reference/: the oracle | the same |
| "cpu" | refused (its kernels read CPU tensors) | cpu/: C kernels and oneDNN products; an error where they are not built |
| "triton" | triton/: hybridkv's Triton kernels | the same under triton's interpreter (TRITON_INTERPRET=1), else an error |
| "flashinfer", "triton+flashinfer" | flashinfer/ | refused |

The one way to choose: `Engine(backend=...)`, `hybridkv serve --backend`,
or `$HYBRIDKV_BACKEND` where neither names one. Nothing else (no free
memory reading, no other variable) changes which backend runs; what a
backend then declines inside a model (a decoder layer it cannot run in
one call, a tied LM head it has no room to pack) is in its prepare
report, which the engine logs once and keeps in `engine.stats`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch

from .base import Backend, Capabilities, PrepareReport
from .reference import ReferenceBackend

CHOICES = ("auto", "torch", "cpu", "triton", "flashinfer", "triton+flashinfer")
ENVIRONMENT = "HYBRIDKV_BACKEND"

__all__ = ["Backend", "Capabilities", "PrepareReport", "CHOICES", "check", "choose"]


def _warn_once(message: str, _said: set = set()) -> None:  # noqa: B006 - one set for the process, on purpose
    if message not in _said:
        _said.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def check(name: str | None, device: torch.device | str) -> None:
    """Refuse a backend that cannot run on `device`, before a model loads:
    the table's refusals and a library that is not installed, a ValueError
    saying why. Only the import is looked for, nothing runs: `choose` then
    tries the backend (the C kernels' build, the kernels' self-test) and
    may still refuse it."""
    name = name or os.environ.get(ENVIRONMENT) or "auto"
    if name not in CHOICES:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(CHOICES)}")
    device = torch.device(device)
    if name == "cpu" and device.type != "cpu":
        raise ValueError(f"backend 'cpu' runs on the CPU, not on {device.type}")
    if "flashinfer" in name and device.type != "cuda":
        raise ValueError(f"backend {name!r} runs on CUDA devices only, not on {device.type}")
    interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")  # as triton/ops.py
    if name == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError(f"backend 'triton' runs on CUDA devices, not on {device.type} (there only under triton's "
                         f"interpreter, TRITON_INTERPRET=1); on the CPU use 'auto' or 'cpu'")
    for library, extra in (("triton", "'hybridkv[triton]'"), ("flashinfer", "flashinfer-python")):
        if library in name and not _installed(library):
            raise ValueError(f"backend {name!r} needs {library}: pip install {extra}")


def _installed(library: str) -> bool:
    """`library` imports (or is imported already: a stand-in has no spec)."""
    return sys.modules.get(library) is not None or importlib.util.find_spec(library) is not None


def choose(name: str | None, device: torch.device | str) -> Backend:
    """The backend `name` asks for on `device` (see the module docstring);
    "auto" falls back only with a warning saying why."""
    name = name or os.environ.get(ENVIRONMENT) or "auto"
    if name not in CHOICES:
        raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(CHOICES)}")
    device = torch.device(device)
    if name == "torch":
        return ReferenceBackend()
    if name in ("flashinfer", "triton+flashinfer"):
        from . import flashinfer

        return flashinfer.FlashInferBackend(device) if name == "flashinfer" else \
            flashinfer.TritonFlashInferBackend(device)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return _cpu(device, required=name == "cpu")
    if name == "auto" and device.type != "cuda":
        return ReferenceBackend()
    return _triton(device, required=name == "triton")


def _cpu(device: torch.device, required: bool) -> Backend:
    from . import cpu

    if device.type != "cpu":
        raise RuntimeError(f"the cpu backend runs on the CPU, not {device.type}")
    try:
        return cpu.CpuBackend()
    except cpu.Unavailable as why:
        if required:
            raise RuntimeError(f"the cpu backend is not available here: {why}") from None
        _warn_once(f"hybridkv: the cpu backend is not available ({why}); running the torch reference")
        return ReferenceBackend()


def _triton(device: torch.device, required: bool) -> Backend:
    from . import triton as triton_backend

    try:
        ops = triton_backend.kernels()
    except ImportError as e:
        if required:
            raise RuntimeError("the triton backend needs triton: pip install 'hybridkv[triton]'") from e
        _warn_once("hybridkv: triton is not installed (pip install 'hybridkv[triton]'); running the torch reference")
        return ReferenceBackend()
    if required:
        if device.type != "cuda" and not ops.INTERPRETED:
            raise RuntimeError("Triton kernels on CPU tensors need triton's interpreter: set TRITON_INTERPRET=1 "
                               "before hybridkv.layers.backends.triton.ops is imported")
        return triton_backend.TritonBackend(ops)
    if triton_backend.verified(ops, device):
        return triton_backend.TritonBackend(ops)
    _warn_once(f"hybridkv: the Triton kernels failed their self-test on {device}; running the torch reference")
    return ReferenceBackend()
