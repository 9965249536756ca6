"""Linear layers over oneDNN's packed weights, swapped in by the cpu backend.

Why: a decode step of a small model on the CPU is a few thin matrix
products that read every weight once, so its speed is the rate at which
the product reads weights. torch's float32 `F.linear` runs MKL's GEMM,
which read Gemma-3 270M's 671 MB LM head in a batch-1 step at under half
the rate of oneDNN's matmul (torch.ops.mkldnn, the op torch.compile's CPU
backend emits) on the same dense weight, and a copy reordered to oneDNN's
blocked layout ("packed") is faster still at batch 16 and 64:
benchmarks/cpu_linear.py measures the three, and its result file names the
machine. The results agree to float32 rounding.

Every Linear is packed and its dense copy dropped where nothing else reads
it. A weight shared with an embedding (a tied LM head) keeps its dense copy
for the embedding's row lookups, so packing it costs its size twice
(Gemma-3 270M: +671 MB) for a product 1.2-1.7x faster at batch 1-64: it is
packed only where the machine has four times its size free, else oneDNN
reads it dense (the prepare report says which).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from ...linear import Linear, onednn_ops
from ..swap import twin


def meminfo() -> dict[str, int]:
    """Linux's /proc/meminfo, its fields in bytes (empty elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1] == "kB"}
    except (OSError, ValueError, IndexError):
        return {}


def spare_memory() -> int:
    """Bytes of memory that can be had now: Linux's MemAvailable, which
    counts the page cache the kernel would drop (a machine that has read a
    few GB of weights holds them there; free pages alone, SC_AVPHYS_PAGES,
    leave that out); elsewhere the free pages; 0 where the system says
    neither."""
    available = meminfo().get("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class OneDNNLinear(Linear):
    matmul = None  # oneDNN's op
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout (None: read dense)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.packed if self.packed is not None else self.weight
        flat = x.reshape(-1, x.shape[-1])
        return self.matmul(flat, weight, self.bias, "none", [], "").view(*x.shape[:-1], self.out_features)


@functools.cache
def onednn_class(kind: type) -> type:
    """The OneDNNLinear of a Linear class: its product over oneDNN, the rest
    of its forward (a tensor-parallel layer's all-reduce or gather) its own."""
    return OneDNNLinear if kind is Linear else type(f"OneDNN{kind.__name__}", (OneDNNLinear, kind), {})


def pack_linears(model: nn.Module, report) -> None:
    """Every Linear of `model` (after loading, fusing and whatever reads
    the dense weights has taken them) swapped for its OneDNNLinear."""
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in parent.named_children()
               if isinstance(child, Linear) and not isinstance(child, OneDNNLinear)]
    if not linears:
        return
    ops = onednn_ops(linears[0][2].weight.device, linears[0][2].weight.dtype)
    if ops is None:
        report.declined.append("oneDNN products: not available or not agreeing with torch here; F.linear runs")
        return
    matmul, reorder = ops
    # Weights another module reads too (an embedding tied to the LM head) keep their dense copy.
    elsewhere = {p.data_ptr() for m in model.modules() if not isinstance(m, Linear)
                 for p in m.parameters(recurse=False)}
    packed = 0
    with torch.no_grad():
        for parent, name, linear in linears:
            new = twin(onednn_class(type(linear)), linear, matmul=matmul)
            weight = linear.weight
            shared = weight.data_ptr() in elsewhere
            size = weight.numel() * weight.element_size()
            if shared and spare_memory() < 4 * size:
                report.declined.append(f"packing {name} ({size / 2**20:.0f} MiB, shared with the embedding): "
                                       f"under 4x its size free; oneDNN reads it dense")
            else:
                new.packed = reorder(weight.detach(), 16)
                packed += 1
                if not shared:
                    new.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
            setattr(parent, name, new)
    report.done.append(f"{len(linears)} Linear layers run oneDNN's products, {packed} over packed weights")
