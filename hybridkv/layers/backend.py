"""Which implementation runs the paged cache ops: the torch reference
(`paged_attention.py`, `mamba_ops.py`) or hybridkv's Triton kernels
(`triton_ops.py`), and the glue that turns the runner's per-step metadata
into kernel arguments.

The choice, `HYBRIDKV_KERNELS` in the environment or `set_backend()`:

* "auto" (default): the kernels for CUDA tensors when triton imports and the
  kernels pass a self-test on that device (once, a few small launches:
  layers/kernel_check.py), the torch reference otherwise (CPU tensors always
  get the reference);
* "torch": always the reference;
* "triton": always the kernels; on CPU tensors this needs triton's
  interpreter (`TRITON_INTERPRET=1` set before the kernels are imported),
  which is how the tests run them without a GPU.

flash-attn and mamba-ssm (the optional `gpu` extra) are not wired in: the
kernels here are the only accelerated path so far (docs/kernels.md).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings

import torch

CHOICES = ("auto", "torch", "triton")
_choice = os.environ.get("HYBRIDKV_KERNELS", "auto")
_ops = None
_available: bool | None = None
_sm_count: dict[int, int] = {}
_verified: dict[str, bool] = {}


def set_backend(name: str) -> None:
    """Pick "auto", "torch" or "triton" for every later call."""
    global _choice
    if name not in CHOICES:
        raise ValueError(f"unknown kernel backend {name!r}: expected one of {', '.join(CHOICES)}")
    _choice = name


def get_backend() -> str:
    return _choice


@contextlib.contextmanager
def use_backend(name: str):
    """`with use_backend("triton"): ...` and back to the previous choice."""
    previous = _choice
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    """Whether triton and the kernels import (checked once)."""
    global _available
    if _available is None:
        try:
            kernels()
            _available = True
        except ImportError:
            _available = False
    return _available


def verified(device: torch.device) -> bool:
    """Whether the kernels passed their self-test on `device` (run once per
    device, layers/kernel_check.py). "auto" keeps the reference where they
    did not, with a warning that says why."""
    key = str(device)
    if key not in _verified:
        from .kernel_check import check

        try:
            check(kernels(), device)
            _verified[key] = True
        except Exception as error:  # noqa: BLE001 - any failure means: do not trust the kernels here
            warnings.warn(f"hybridkv: Triton kernels failed their self-test on {device} ({error}); "
                          f"using the torch reference", RuntimeWarning, stacklevel=2)
            _verified[key] = False
    return _verified[key]


def kernels():
    """The kernel module, imported on first use (triton reads
    TRITON_INTERPRET when it decorates them)."""
    global _ops
    if _ops is None:
        _ops = importlib.import_module("hybridkv.layers.triton_ops")
    return _ops


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor `t` (the cache) runs the Triton kernels."""
    if _choice == "torch":
        return False
    if _choice == "auto":
        return t.is_cuda and triton_available() and verified(t.device)
    if not triton_available():
        raise RuntimeError("HYBRIDKV_KERNELS=triton but triton is not importable (pip install 'hybridkv[triton]')")
    if not t.is_cuda and not kernels().INTERPRETED:
        raise RuntimeError("Triton kernels on CPU tensors need triton's interpreter: set TRITON_INTERPRET=1 "
                           "before hybridkv.layers.triton_ops is imported")
    return True


# -- metadata -> kernel arguments (built once per step and group, shared by the group's layers) --
def _cached(meta, key, build):
    inputs = meta.kernel_inputs
    if key not in inputs:
        inputs[key] = build()
    return inputs[key]


def _padded_tables(tables: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate page tables along `dim` after padding their last
    (blocks) dimension with the null page; the kernels never read padding."""
    width = max(t.shape[-1] for t in tables)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tables], dim=dim)


def _decode_inputs(meta):
    groups = meta.decodes
    return (torch.cat([g.rows for g in groups]),
            _padded_tables([g.pages for g in groups], dim=1).contiguous(),  # [width, requests, blocks]
            torch.cat([g.query_pos for g in groups]),
            torch.cat([g.key_pos for g in groups]))


def _prefill_inputs(meta, device):
    segs = meta.prefills

    def ints(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return (ints([s.start for s in segs]), ints([s.length for s in segs]),
            _padded_tables([s.pages.unsqueeze(1) for s in segs], dim=1).contiguous(),  # [width, segments, blocks]
            ints([s.query_pos for s in segs]), ints([s.key_pos for s in segs]), max(s.length for s in segs))


def decode_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Key splits per decode program: enough programs to fill the GPU's SMs
    when requests x KV heads are few, never slices under 512 keys."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count:
        _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sms = _sm_count[index]
    if programs >= sms:
        return 1
    return max(1, min(16, -(-2 * sms // programs), max_keys // 512))


def store_kv(cache, k, v, meta, column):
    slots = _cached(meta, "slots", lambda: meta.store_pages * meta.block_size + meta.store_offsets)
    kernels().store_kv(cache, k, v, slots[column])


def paged_attention(q, cache, meta, column, scale, softcap):
    ops = kernels()
    out = torch.empty_like(q)
    common = dict(kind=meta.kind, window=meta.window, chunk=meta.chunk, scale=scale, softcap=softcap)
    if meta.decodes:
        rows, tables, q_pos, k_pos = _cached(meta, "decode", lambda: _decode_inputs(meta))
        splits = decode_splits(q.device, rows.shape[0] * cache.shape[3], tables.shape[-1] * meta.block_size)
        ops.paged_decode_attention(out, q, cache, rows, tables[column], q_pos, k_pos, splits=splits, **common)
    if meta.prefills:
        starts, lengths, tables, q_pos, k_pos, longest = _cached(meta, "prefill",
                                                                 lambda: _prefill_inputs(meta, q.device))
        ops.paged_prefill_attention(out, q, cache, starts, lengths, tables[column], q_pos, k_pos,
                                    max_length=longest, **common)
    return out
