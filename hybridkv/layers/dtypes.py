"""torch dtypes by name: the one mapping from the core's dtype names
(`core/dtypes.py`) to torch that the KV buffers, the loader and the engine
share, and what `dtype="auto"` means on a device."""

from __future__ import annotations

import os

import torch

from ..core.dtypes import DTYPE_SIZES, MODEL_DTYPES, dtype_name
from ..core.native import cpu_flags

# Where an engine's dtype is None: this variable, else "auto".
ENVIRONMENT = "HYBRIDKV_DTYPE"

# CPU flags (Linux /proc/cpuinfo) saying the CPU computes bfloat16 products
# itself: x86's AVX-512 BF16 and AMX tiles, Arm's BF16 extension. Without
# them a bfloat16 product widens every element in software and runs slower
# than float32.
NATIVE_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

# The core names its dtypes as torch does, so the mapping is read off torch
# rather than written again; a float8 type this torch build lacks is absent.
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}


def native_bfloat16_flag(flags: str | None = None) -> str | None:
    """The first of NATIVE_BFLOAT16_FLAGS this CPU reports, or None."""
    found = set((cpu_flags() if flags is None else flags).replace(":", " ").split())
    return next((flag for flag in NATIVE_BFLOAT16_FLAGS if flag in found), None)


def choose_dtype(dtype, device, checkpoint_dtype=None, flags: str | None = None) -> tuple[torch.dtype, str]:
    """(the weights' and activations' torch dtype, why) for an engine's
    `dtype` option on `device`. None reads $HYBRIDKV_DTYPE, else "auto".
    "auto" on the CPU: bfloat16 where the CPU computes it natively, float32
    elsewhere, whatever the checkpoint holds (a float32 checkpoint runs in
    bfloat16 too, as vLLM's CPU build does); on an accelerator, the
    checkpoint's dtype (float32 where it names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for"
    source = "asked for"
    if dtype is None:
        dtype = os.environ.get(ENVIRONMENT) or "auto"
        source = f"${ENVIRONMENT}" if dtype != "auto" else source
    if dtype != "auto":
        name = dtype_name(dtype)
        if name not in MODEL_DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(map(repr, MODEL_DTYPES))}, "
                             f"got {dtype!r}" + (f" (from ${ENVIRONMENT})" if source != "asked for" else ""))
        return TORCH_DTYPES[name], source
    if torch.device(device).type == "cpu":
        flag = native_bfloat16_flag(flags)
        if flag is not None:
            return torch.bfloat16, f"auto: the CPU computes bfloat16 natively ({flag})"
        return torch.float32, "auto: the CPU has no native bfloat16 (no avx512_bf16, amx_bf16 or bf16 flag)"
    if isinstance(checkpoint_dtype, torch.dtype):
        return checkpoint_dtype, "auto: the checkpoint's"
    name = dtype_name(checkpoint_dtype)
    if name in MODEL_DTYPES:
        return TORCH_DTYPES[name], "auto: the checkpoint's"
    return torch.float32, "auto: the checkpoint names no dtype"
