"""Routing tokens through a mixture of experts, for every family with one
(Jamba, Granite-4.0-H, Nemotron-H): the families choose the experts and
their weights (each its own router), this sums the chosen experts' outputs.

Eagerly only the chosen experts run, each on its tokens. In a captured or
traced step (`capturing`) every expert runs on every token, weighted by
its routing weight (zero where not chosen), so that no shape depends on
the routing; at decode sizes the experts' weights are read once either
way.
"""

from __future__ import annotations

import torch

from ..layers.step import capturing


def mix_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, expert, num_experts: int,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum over k of weights[:, k] * expert(chosen[:, k], x) for x [T, H];
    weights, chosen [T, top_k]; `expert(e, rows)` runs expert e on rows.
    Summed in `dtype` (x's by default)."""
    out = torch.zeros(x.shape, dtype=dtype or x.dtype, device=x.device)
    if capturing(x):
        for e in range(num_experts):
            weight = (weights * (chosen == e)).sum(-1, keepdim=True)
            out += (expert(e, x) * weight).to(out.dtype)
        return out
    for e in torch.unique(chosen).tolist():
        token_idx, slot = torch.where(chosen == e)
        y = expert(e, x[token_idx]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
