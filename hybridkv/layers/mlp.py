"""The gated MLP every decoder family here uses (Hugging Face parameter
names): down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .linear import Linear
from .parallel import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `kind` names the activation: "silu",
    "gelu_tanh" (GELU's tanh form) or "gelu"."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu", reduce: bool = True):
        """`intermediate`: the whole width, of which a tensor-parallel rank
        holds its share (gate and up by rows, down by columns: parallel.py);
        `reduce=False`: down's partial sums are left to the caller (a
        mixture of experts sums its experts' first, then reduces once)."""
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, bias=False)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=False)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=False, reduce=reduce)
        self.gate_up_proj: Linear | None = None
        if activation in ("silu", "swish"):
            self.act, self.kind = F.silu, "silu"
        elif activation.startswith("gelu"):
            approximate = "tanh" if "tanh" in activation else "none"
            self.act = lambda x: F.gelu(x, approximate=approximate)
            self.kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        else:
            raise ValueError(f"unsupported activation {activation!r}")

    def fuse(self) -> None:
        """After loading: gate and up as one product (`gate_up_proj`)."""
        self.gate_up_proj = Linear.fused([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def activated(self, x):
        """act(gate(x)) * up(x)."""
        if self.gate_up_proj is None:
            return self.act(self.gate_proj(x)) * self.up_proj(x)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x):
        return self.down_proj(self.activated(x))
