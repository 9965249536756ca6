"""The implementation a step's cache ops run on, chosen once when the engine
starts: the torch reference (paged_attention.py, mamba_state.TorchMamba) or
hybridkv's Triton kernels (kernel_attention.py, mamba_state.KernelMamba,
triton_ops.py). Models call `backend.attention.*` and `backend.mamba.*`;
each side builds its own metadata for the step (`build`), once per group,
from what they share (step.py: `StepInputs`, and an attention group's
`AttentionStep`).

    backend = choose("auto", device)

* "auto" (default; `HYBRIDKV_KERNELS` overrides): the kernels on CUDA when
  triton imports and they pass a self-test on that device (a few small
  launches against dense torch written from the rules: kernel_check.py; a
  failure warns and keeps the reference); "cpu" on the CPU where its C
  kernel builds and passes its self-test, else the reference;
* "torch": the reference everywhere;
* "cpu": the reference with its decode attention through hybridkv's C
  kernel, which reads each query's keys in place in the pool
  (cpu_attention.py, built by cpu_native.py on first use);
* "triton": the kernels, no self-test; on CPU tensors this needs triton's
  interpreter (`TRITON_INTERPRET=1` set before the kernels are imported),
  which is how the tests run them without a GPU;
* "flashinfer": FlashInfer's paged attention (flashinfer_attention.py: CUDA,
  16-bit caches, full and sliding-window layers) after its self-test, and
  for Mamba layers mamba-ssm's state update where it imports
  (mamba_ssm_state.py), else hybridkv's kernels, else the reference. Its
  steps are eager (no CUDA graphs). Not picked by "auto": a choice to
  measure against the kernels (benchmarks/kernels.py).
* "triton+flashinfer": hybridkv's kernels for stores, decodes (captured in
  CUDA graphs) and Mamba steps, FlashInfer's prefill for the chunks of eager
  steps (flashinfer_attention.FlashInferPrefill), after both self-tests: on
  an H100 FlashInfer's prefill kernel was 3.8-8.6x faster than hybridkv's
  and its decode no faster than hybridkv's at the swept tiles. Not picked
  by "auto" either: its end-to-end gain is unmeasured, and FlashInfer
  compiles each head size's kernels on first use (about a minute each).
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch

from . import kernel_attention, paged_attention
from .mamba_state import KernelMamba, TorchMamba

CHOICES = ("auto", "torch", "cpu", "triton", "flashinfer", "triton+flashinfer")


class TorchAttention:
    name = "torch"
    build = staticmethod(paged_attention.build)
    store = staticmethod(paged_attention.store)
    attend = staticmethod(paged_attention.attend)


class KernelAttention:
    name = "triton"
    build = staticmethod(kernel_attention.build)

    def __init__(self, ops):
        self.ops = ops

    def store(self, cache, k, v, meta, column):
        kernel_attention.store(self.ops, cache, k, v, meta, column)

    def attend(self, q, cache, meta, column, scale, softcap=None):
        return kernel_attention.attend(self.ops, q, cache, meta, column, scale, softcap)


class Backend:
    def __init__(self, name: str, attention, mamba, bind_model=None):
        self.name = name
        self.attention = attention
        self.mamba = mamba
        # Can a fixed-shape decode step through it be captured as a CUDA graph?
        self.capturable = getattr(attention, "capturable", True)
        self._bind_model = bind_model

    def bind(self, model) -> None:
        """Give the model's other modules what this backend also runs for
        them (the "cpu" backend: norms, rotary and activations in C, and
        whole decoder layers for small decode steps). Before the Linear
        layers are configured: a bound decoder layer keeps their dense weights."""
        if self._bind_model is not None:
            self._bind_model(model)

    def check_layout(self, layout) -> None:
        """Raise ValueError if the attention side cannot run some group of
        `layout` (the reference and the kernels run every one)."""
        check = getattr(self.attention, "check_layout", None)
        if check is not None:
            check(layout)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


TORCH = Backend("torch", TorchAttention(), TorchMamba())


def kernels():
    """The kernel module, imported on first use (triton reads
    TRITON_INTERPRET when it decorates them)."""
    return importlib.import_module("hybridkv.layers.triton_ops")


def kernel_backend() -> Backend:
    ops = kernels()
    return Backend("triton", KernelAttention(ops), KernelMamba(ops))


def choose(name: str | None, device: torch.device | str) -> Backend:
    """The backend for `device` (see the module docstring)."""
    name = name or os.environ.get("HYBRIDKV_KERNELS", "auto")
    if name not in CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}: expected one of {', '.join(CHOICES)}")
    device = torch.device(device)
    if name == "torch":
        return TORCH
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        return cpu_backend(required=name == "cpu")
    if name == "auto" and device.type != "cuda":
        return TORCH
    if name in ("flashinfer", "triton+flashinfer"):
        return flashinfer_backend(device, prefill_only=name == "triton+flashinfer")
    try:
        ops = kernels()
    except ImportError as e:
        if name == "triton":
            raise RuntimeError("the triton backend needs triton: pip install 'hybridkv[triton]'") from e
        return TORCH
    if name == "triton":
        if device.type != "cuda" and not ops.INTERPRETED:
            raise RuntimeError("Triton kernels on CPU tensors need triton's interpreter: set TRITON_INTERPRET=1 "
                               "before hybridkv.layers.triton_ops is imported")
        return kernel_backend()
    return kernel_backend() if verified(ops, device) else TORCH


_cpu: list[Backend] = []


def cpu_backend(required: bool) -> Backend:
    """The "cpu" backend once its C kernel is built and passes its
    self-test; otherwise the reference, or an error when it was asked for."""
    if not _cpu:
        from . import cpu_attention, cpu_decoder, cpu_fused, cpu_native

        lib = cpu_native.library()
        if lib is None:
            if required:
                raise RuntimeError("the cpu backend needs its C kernel, which could not be built here "
                                   "(a C compiler with OpenMP: cc, gcc or clang; HYBRIDKV_NATIVE=0 turns it off)")
            return TORCH
        attention = cpu_attention.NativeAttention(lib)
        try:
            cpu_attention.check(attention)
            backend = Backend("cpu", attention, TorchMamba(), bind_model=lambda model: (
                cpu_fused.configure(model, lib), cpu_decoder.configure(model, lib)))
        except AssertionError as error:
            warnings.warn(f"hybridkv: the CPU kernel failed its self-test ({error}); using the torch reference",
                          RuntimeWarning, stacklevel=3)
            backend = TORCH
        _cpu.append(backend)
    if required and _cpu[0] is TORCH:
        raise RuntimeError("hybridkv's CPU kernel failed its self-test here")
    return _cpu[0]


_verified: dict[str, bool] = {}


def verified(ops, device: torch.device) -> bool:
    """Whether the kernels pass their self-test on `device` (once per device)."""
    key = str(device)
    if key not in _verified:
        from .kernel_check import check

        try:
            check(ops, device)
            _verified[key] = True
        except Exception as error:  # noqa: BLE001 - any failure means: do not trust the kernels here
            warnings.warn(f"hybridkv: Triton kernels failed their self-test on {device} ({error}); "
                          f"using the torch reference", RuntimeWarning, stacklevel=3)
            _verified[key] = False
    return _verified[key]


def flashinfer_backend(device: torch.device, prefill_only: bool = False) -> Backend:
    """FlashInfer's attention, mamba-ssm's (or hybridkv's) Mamba step; with
    `prefill_only`, FlashInfer's prefill beside hybridkv's kernels."""
    try:
        import flashinfer
    except ImportError as e:
        raise RuntimeError("the flashinfer backend needs FlashInfer: pip install flashinfer-python "
                           "(benchmarks/gpu_wheels.sh fetches it for a machine without an index)") from e
    if device.type != "cuda":
        raise RuntimeError("FlashInfer's kernels run on CUDA devices only")
    from . import flashinfer_attention
    from .mamba_ssm_state import MambaSsmMamba, load_kernels

    if prefill_only:
        ops = kernels()  # the caller asked for them: a failing self-test raises
        if not verified(ops, device):
            raise RuntimeError(f"hybridkv's Triton kernels failed their self-test on {device}")
        attention = flashinfer_attention.FlashInferPrefill(flashinfer, device, ops)
        flashinfer_attention.check(attention.prefill, device)
        return Backend("triton+flashinfer", attention, KernelMamba(ops))
    attention = flashinfer_attention.FlashInferAttention(flashinfer, device)
    flashinfer_attention.check(attention, device)  # a mismatch raises: the caller asked for this backend
    mamba_kernels = load_kernels()
    if mamba_kernels is not None:
        mamba = MambaSsmMamba(*mamba_kernels)
    else:
        try:
            ops = kernels()
            mamba = KernelMamba(ops) if verified(ops, device) else TorchMamba()
        except ImportError:
            mamba = TorchMamba()
    return Backend("flashinfer", attention, mamba)
