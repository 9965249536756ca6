"""Linear layers whose matrix product is chosen once, for the device.

Why not always `F.linear`: a decode step of a small model on the CPU is a
few thin matrix products that read every weight once, so its speed is the
rate at which the product reads weights. torch's float32 `F.linear` runs
MKL's GEMM, which read Gemma-3 270M's 671 MB LM head in a batch-1 step at
under half the rate of oneDNN's matmul (torch.ops.mkldnn, the op
torch.compile's CPU backend emits) on the same dense weight, and a copy
reordered to oneDNN's blocked layout ("packed") is faster still at batch 16
and 64: benchmarks/cpu_linear.py measures the three, and its result file
names the machine. The results agree to float32 rounding (the order of the
sums differs).

Choices (`configure(model, device)`, once at engine start):
  "torch"   F.linear: CUDA (cuBLAS), dtypes other than float32, or where the
            oneDNN op is missing or fails its check;
  "onednn"  float32 on the CPU: every weight is packed. The dense copy is
            dropped where nothing else reads it; a weight shared with an
            embedding (a tied LM head) keeps it for the embedding's row
            lookups, so a packed tied head costs its size twice (Gemma-3
            270M: +671 MB) for a product 1.2-1.7x faster at batch 1-64. It
            is packed only where the machine has four times its size free
            (Gemma-3 27B's would be 5.6 GB); otherwise oneDNN reads it dense.
`HYBRIDKV_LINEAR=torch` forces F.linear.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

CHOICES = ("torch", "onednn")


def _onednn_ops():
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return ops._linear_pointwise, ops._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


def _onednn_agrees(matmul, reorder) -> bool:
    """oneDNN against F.linear on a small product, dense and packed."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((5, 64), (96, 64), (96,)))
    try:
        expected = F.linear(x, w, b)
        for weight in (w, reorder(w, 5)):
            if not torch.allclose(matmul(x, weight, b, "none", [], ""), expected, rtol=1e-4, atol=1e-4):
                return False
    except RuntimeError:
        return False
    return True


def choose(device: torch.device, dtype: torch.dtype) -> str:
    if os.environ.get("HYBRIDKV_LINEAR") == "torch" or device.type != "cpu" or dtype != torch.float32:
        return "torch"
    ops = _onednn_ops()
    return "onednn" if ops is not None and _onednn_agrees(*ops) else "torch"


_products: dict[tuple, object] = {}
# oneDNN builds a primitive (JIT code) for each new shape, ~0.5 ms on this
# project's machines, then caches it: below this many multiply-adds a
# product goes to torch.mm, where that cost would outweigh the gain.
ONEDNN_MIN_PRODUCT = 1 << 22


def product_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x [m, k] and w [n, k], any strides: oneDNN's matmul where
    `choose` picks it (float32 on the CPU), the product is big enough
    (ONEDNN_MIN_PRODUCT) and both operands are dense (w may be a
    transposed dense one), else torch.mm. Attention's products on the CPU go
    through here: at its shapes (a few hundred rows of 256) oneDNN runs
    2.1-2.3x faster than MKL's GEMM on this project's machines. Callers
    keep the number of distinct shapes small (paged_attention buckets them):
    each new one costs a primitive."""
    key = (x.device.type, x.dtype, os.environ.get("HYBRIDKV_LINEAR"))
    onednn = _products.get(key)
    if onednn is None:
        onednn = _products[key] = _onednn_ops()[0] if choose(x.device, x.dtype) == "onednn" else False
    if (onednn is False or x.shape[0] * x.shape[1] * w.shape[0] < ONEDNN_MIN_PRODUCT or not x.is_contiguous()
            or not (w.is_contiguous() or w.t().is_contiguous())):
        # (oneDNN reads other strides through a slow reference path: 49 ms
        # where torch.mm takes 0.2 on a [192, 32] x [32, 768] product.)
        return torch.mm(x, w.t())
    return onednn(x, w, None, "none", [], "")


def spare_memory() -> int:
    """Bytes of memory free now (0 where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) whose product is
    F.linear until `configure` picks oneDNN."""

    _matmul = None  # oneDNN's op once chosen
    _packed: torch.Tensor | None = None  # the weight in oneDNN's layout (the dense one is then dropped)

    @classmethod
    def fused(cls, parts: list[nn.Linear]) -> "Linear":
        """One Linear computing `parts` side by side (their outputs
        concatenated): one weight read and one call instead of several."""
        weight = torch.cat([p.weight.data for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias.data for p in parts])
        out = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        out.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._matmul is None:
            return F.linear(x, self.weight, self.bias)
        weight = self._packed if self._packed is not None else self.weight
        flat = x.reshape(-1, x.shape[-1])
        return self._matmul(flat, weight, self.bias, "none", [], "").view(*x.shape[:-1], self.out_features)


def configure(model: nn.Module, device: torch.device) -> str:
    """Choose the product for every Linear of `model` (after loading and
    fusing); returns the choice."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        return "torch"
    choice = choose(torch.device(device), linears[0].weight.dtype)
    if choice == "torch":
        return choice
    matmul, reorder = _onednn_ops()
    # Weights that some other module reads too (an embedding tied to the LM head) keep their dense copy.
    elsewhere = {p.data_ptr() for m in model.modules() if not isinstance(m, Linear)
                 for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for linear in linears:
            linear._matmul = matmul
            shared = linear.weight.data_ptr() in elsewhere
            if shared and spare_memory() < 4 * linear.weight.numel() * linear.weight.element_size():
                continue  # no room for a second copy: read dense
            linear._packed = reorder(linear.weight.detach(), 16)
            if not shared:
                linear.weight = nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
    return choice
