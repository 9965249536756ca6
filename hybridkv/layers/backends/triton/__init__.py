"""hybridkv's Triton kernels (ops.py): stores, paged decode and prefill
attention, the Mamba decode step and prefill scan, reading and writing the
pool in place, and the norms' and gated MLPs' elementwise work (modules.py).
On CUDA devices, compiled; on CPU tensors under triton's interpreter
(`TRITON_INTERPRET=1` set before ops.py is imported), which is how the
tests run them without a GPU.

ops.py is imported only when the backend is built, because triton reads
TRITON_INTERPRET when it decorates the kernels. Before "auto" trusts the
kernels on a device they pass a self-test there (check.py), once.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from ....core.dtypes import KV_CACHE_DTYPES
from ..base import Backend, Capabilities


def kernels():
    """The kernel module, imported on first use."""
    return importlib.import_module("hybridkv.layers.backends.triton.ops")


class TritonBackend(Backend):
    name = "triton"
    # 16-bit and float32 pages, and int8 / float8 codes with their scales (kv_quant.py).
    # Kernels for Mamba-1, Mamba-2 and Gated DeltaNet (recurrent.py); short-conv layers run the reference's ops.
    capabilities = Capabilities(reads_only_visible_keys=True, dtypes=frozenset(KV_CACHE_DTYPES),
                                recurrent_kinds=frozenset({"mamba", "mamba2", "gated_delta"}))

    def __init__(self, ops=None):
        from .attention import TritonAttention
        from .recurrent import recurrent_ops

        ops = ops or kernels()
        self.ops = ops
        super().__init__(TritonAttention(ops), recurrent_ops(ops))

    def prepare(self, model, layout, device):
        report = super().prepare(model, layout, device)
        swap_modules(model, self.ops, report)
        return report


def swap_modules(model, ops, report) -> None:
    """The model's RMS norms and gated MLPs for their Triton twins (modules.py)."""
    from .modules import swap_norms_and_mlps

    norms, mlps = swap_norms_and_mlps(model, ops)
    report.done.append(f"{norms} RMS norms (with the q/k rotation) and {mlps} gated MLPs' activations run "
                       f"one Triton kernel each")


_verified: dict[str, bool] = {}


def verified(ops, device: torch.device) -> bool:
    """Whether the kernels pass their self-test on `device` (once per
    device); a failure warns, naming the kernel."""
    key = str(device)
    if key not in _verified:
        from .check import check

        try:
            check(ops, device)
            _verified[key] = True
        except Exception as error:  # noqa: BLE001 - any failure means: do not trust the kernels here
            warnings.warn(f"hybridkv: Triton kernels failed their self-test on {device} ({error})",
                          RuntimeWarning, stacklevel=3)
            _verified[key] = False
    return _verified[key]
