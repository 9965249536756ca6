"""The field's kernels behind hybridkv's contract, on CUDA only, never
picked by "auto" (choices to measure against hybridkv's kernels,
benchmarks/kernels.py):

* "flashinfer": FlashInfer's paged attention (attention.py: 16-bit caches,
  full and sliding-window layers, no attention sinks) after its self-test, and for Mamba
  layers mamba-ssm's state update where it imports (mamba_ssm.py), else
  hybridkv's Triton kernels, else the reference. Its steps are eager
  (FlashInfer plans each step from host data): no CUDA graphs.
* "triton+flashinfer": hybridkv's kernels for stores, decodes (captured in
  CUDA graphs) and Mamba steps, FlashInfer's prefill for the chunks of
  eager steps (attention.FlashInferPrefill), after both self-tests: on an
  H100 FlashInfer's prefill kernel was 3.8-8.6x faster than hybridkv's and
  its decode no faster at the swept tiles. Layers with attention sinks run
  on hybridkv's kernels whole.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ....core.specs import RECURRENT_KINDS
from ..base import Backend, Capabilities, sink_layers
from ..triton import TritonBackend, kernels, verified

SIXTEEN_BIT = frozenset({"bfloat16", "float16"})


def _flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("the flashinfer backends need FlashInfer: pip install flashinfer-python "
                           "(benchmarks/gpu_wheels.sh fetches it for a machine without an index)") from e
    return flashinfer


def _verified_kernels(device: torch.device):
    ops = kernels()
    if not verified(ops, device):
        raise RuntimeError(f"hybridkv's Triton kernels failed their self-test on {device}")
    return ops


def _recurrent_ops(device: torch.device) -> tuple[dict, frozenset]:
    """The flashinfer backend's recurrent ops and the kinds they step their
    own way: mamba-ssm's for Mamba-1 where it imports, else hybridkv's
    Triton kernels' where they pass their self-test, else the reference's."""
    from .mamba_ssm import load_kernels, recurrent_ops

    mamba_kernels = load_kernels()
    if mamba_kernels is not None:
        return recurrent_ops(*mamba_kernels), frozenset({"mamba"})
    try:
        ops = kernels()
        if verified(ops, device):
            return TritonBackend(ops).recurrent, TritonBackend.capabilities.recurrent_kinds
    except ImportError:
        pass
    from ..reference.recurrent import recurrent_ops as reference_ops

    return reference_ops(), frozenset(RECURRENT_KINDS)


class FlashInferBackend(Backend):
    name = "flashinfer"
    # (`recurrent_kinds`: by the recurrent ops it finds, `_recurrent_ops`)
    capabilities = Capabilities(devices=frozenset({"cuda"}), dtypes=SIXTEEN_BIT,
                                attention_kinds=frozenset({"full", "sliding_window"}), sinks=False,
                                capturable=False, recurrent_kinds=frozenset({"mamba"}))

    def __init__(self, device: torch.device):
        from . import attention

        flashinfer = _flashinfer()  # not installed: say what to install first
        if device.type != "cuda":
            raise RuntimeError("FlashInfer's kernels run on CUDA devices only")
        ops = attention.FlashInferAttention(flashinfer, device)
        attention.check(ops, device)  # a mismatch raises: the caller asked for this backend
        recurrent, kinds = _recurrent_ops(device)
        self.capabilities = replace(self.capabilities, recurrent_kinds=kinds)
        super().__init__(ops, recurrent)

    def prepare(self, model, layout, device):
        report = super().prepare(model, layout, device)
        stepping = self.recurrent["mamba"].name
        if stepping != "mamba-ssm" and any(g.recurrent for g in layout.groups):
            report.declined.append(f"mamba-ssm's state update (not installed): Mamba steps run {stepping}")
        return report


class TritonFlashInferBackend(Backend):
    name = "triton+flashinfer"
    capabilities = Capabilities(devices=frozenset({"cuda"}),
                                recurrent_kinds=TritonBackend.capabilities.recurrent_kinds)

    def __init__(self, device: torch.device):
        from ..triton.recurrent import recurrent_ops
        from . import attention

        flashinfer = _flashinfer()
        if device.type != "cuda":
            raise RuntimeError("FlashInfer's kernels run on CUDA devices only")
        ops = _verified_kernels(device)
        prefill = attention.FlashInferPrefill(flashinfer, device, ops)
        attention.check(prefill.prefill, device)
        self.ops = ops
        super().__init__(prefill, recurrent_ops(ops))

    def prepare(self, model, layout, device):
        from ..triton import swap_modules

        report = super().prepare(model, layout, device)
        swap_modules(model, self.ops, report)
        others = [g.index for g in layout.groups if not g.recurrent and
                  (g.spec.kind not in ("full", "sliding_window") or g.spec.dtype not in SIXTEEN_BIT)]
        if others:
            report.declined.append(f"FlashInfer's prefill for groups {others} (chunked local or float32): "
                                   f"they run hybridkv's kernels whole")
        with_sinks = sink_layers(model)
        if with_sinks:
            report.declined.append(f"FlashInfer's prefill for the {len(with_sinks)} layers with attention sinks "
                                   f"(not taken, attention.py): they run hybridkv's kernels whole")
        return report
