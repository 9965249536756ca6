"""Linear layers and the CPU's matrix product.

`Linear` is nn.Linear (same parameters and checkpoint names) that can be
fused with its siblings after loading (q/k/v, gate/up: one weight read and
one call). How its product runs is a backend's business: the cpu backend
swaps it for one over oneDNN's packed weights (backends/cpu/linear.py).
Its tensor-parallel kinds are in parallel.py.

`product_nt` is the product attention's tiles use on the CPU in every
backend: oneDNN's matmul (torch.ops.mkldnn) where it is present and agrees
with torch, which ran 2.1-2.3x faster than MKL's GEMM at attention's
shapes where it was measured (benchmarks/cpu_linear.py; its result file
names the CPU). The results agree to float32 rounding (the order of the
sums differs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _onednn_ops():
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return ops._linear_pointwise, ops._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None


# How close oneDNN's product must come to F.linear's in float32, per
# dtype: float32 rounding, and bfloat16's (its operands are bfloat16; the
# sums' order and the output's one rounding differ).
_AGREEMENT = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _onednn_agrees(matmul, reorder, dtype: torch.dtype) -> bool:
    """oneDNN against F.linear on a small product, dense and packed."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((5, 64), (96, 64), (96,)))
    try:
        expected = F.linear(x.float(), w.float(), b.float())
        for weight in (w, reorder(w, 5)):
            if not torch.allclose(matmul(x, weight, b, "none", [], "").float(), expected, **_AGREEMENT[dtype]):
                return False
    except RuntimeError:
        return False
    return True


def onednn_ops(device: torch.device, dtype: torch.dtype):
    """oneDNN's (matmul, reorder) for float32 and bfloat16 on the CPU where
    present and agreeing with F.linear; else None."""
    if device.type != "cpu" or dtype not in _AGREEMENT:
        return None
    ops = _onednn_ops()
    return ops if ops is not None and _onednn_agrees(*ops, dtype) else None


_products: dict[tuple, object] = {}
# oneDNN builds a primitive (JIT code) for each new shape, ~0.5 ms on this
# project's machines, then caches it: below this many multiply-adds a
# product goes to torch.mm, where that cost would outweigh the gain.
ONEDNN_MIN_PRODUCT = 1 << 22


def product_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x [m, k] and w [n, k], any strides: oneDNN's matmul where
    `onednn_ops` gives it (float32 or bfloat16 on the CPU), the product is big enough
    (ONEDNN_MIN_PRODUCT) and both operands are dense (w may be a
    transposed dense one), else torch.mm. Attention's products on the CPU go
    through here: at its shapes (a few hundred rows of 256) oneDNN runs
    2.1-2.3x faster than MKL's GEMM where it was measured
    (benchmarks/cpu_linear.py). Callers keep the number of distinct shapes
    small (the reference attention buckets them): each new one costs a
    primitive."""
    key = (x.device.type, x.dtype)
    onednn = _products.get(key)
    if onednn is None:
        ops = onednn_ops(x.device, x.dtype)
        onednn = _products[key] = ops[0] if ops is not None else False
    if (onednn is False or x.shape[0] * x.shape[1] * w.shape[0] < ONEDNN_MIN_PRODUCT or not x.is_contiguous()
            or not (w.is_contiguous() or w.t().is_contiguous())):
        # (oneDNN reads other strides through a slow reference path: 49 ms
        # where torch.mm takes 0.2 on a [192, 32] x [32, 768] product.)
        return torch.mm(x, w.t())
    return onednn(x, w, None, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) that siblings can
    be fused into after loading. Its product is a method of its own
    (`product`), so that a backend swaps how the product runs while a
    subclass keeps what its forward does around it (parallel.py's layers
    sum or gather their ranks' products)."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

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
