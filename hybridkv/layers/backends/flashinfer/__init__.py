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

import torch

from ..base import Backend, Capabilities, sink_layers

SIXTEEN_BIT = frozenset({"bfloat16", "float16"})


def _flashinfer():
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("the flashinfer backends need FlashInfer: pip install flashinfer-python "
                           "(benchmarks/gpu_wheels.sh fetches it for a machine without an index)") from e
    return flashinfer


def _verified_kernels(device: torch.device):
    from ..triton import kernels, verified

    ops = kernels()
    if not verified(ops, device):
        raise RuntimeError(f"hybridkv's Triton kernels failed their self-test on {device}")
    return ops


class FlashInferBackend(Backend):
    name = "flashinfer"
    capabilities = Capabilities(devices=frozenset({"cuda"}), dtypes=SIXTEEN_BIT,
                                attention_kinds=frozenset({"full", "sliding_window"}), sinks=False,
                                capturable=False)

    def __init__(self, device: torch.device):
        from . import attention
        from .mamba_ssm import MambaSsmRecurrent, load_kernels

        flashinfer = _flashinfer()  # not installed: say what to install first
        if device.type != "cuda":
            raise RuntimeError("FlashInfer's kernels run on CUDA devices only")
        ops = attention.FlashInferAttention(flashinfer, device)
        attention.check(ops, device)  # a mismatch raises: the caller asked for this backend
        mamba_kernels = load_kernels()
        if mamba_kernels is not None:
            recurrent = MambaSsmRecurrent(*mamba_kernels)
        else:
            try:
                from ..triton import TritonBackend, kernels, verified

                ops_k = kernels()
                recurrent = TritonBackend(ops_k).recurrent if verified(ops_k, device) else None
            except ImportError:
                recurrent = None
            if recurrent is None:
                from ..reference.recurrent import ReferenceRecurrent

                recurrent = ReferenceRecurrent()
        super().__init__(ops, recurrent)

    def prepare(self, model, layout, device):
        report = super().prepare(model, layout, device)
        if self.recurrent.name != "mamba-ssm" and any(g.recurrent for g in layout.groups):
            report.declined.append(f"mamba-ssm's state update (not installed): Mamba steps run {self.recurrent.name}")
        return report


class TritonFlashInferBackend(Backend):
    name = "triton+flashinfer"
    capabilities = Capabilities(devices=frozenset({"cuda"}))

    def __init__(self, device: torch.device):
        from ..triton.recurrent import TritonRecurrent
        from . import attention

        flashinfer = _flashinfer()
        if device.type != "cuda":
            raise RuntimeError("FlashInfer's kernels run on CUDA devices only")
        ops = _verified_kernels(device)
        prefill = attention.FlashInferPrefill(flashinfer, device, ops)
        attention.check(prefill.prefill, device)
        super().__init__(prefill, TritonRecurrent(ops))

    def prepare(self, model, layout, device):
        from ..triton import swap_modules

        report = super().prepare(model, layout, device)
        swap_modules(model, self.recurrent.ops, report)
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
