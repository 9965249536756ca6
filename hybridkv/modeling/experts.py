"""A mixture of experts' two shared parts: the router, which chooses each
token's experts and their weights, and `mix_experts`, which sums the
chosen experts' outputs.

The families' routers differ only in a few rules, the fields of `Routing`:
how logits become scores (softmax or sigmoid), whether the top-k is taken
before scoring (a softmax over the k best logits) or after, whether the
chosen weights are renormalised and scaled, the biases, and the dtypes.

Eagerly only the chosen experts run, each on its tokens. In a captured or
traced step (`capturing`) every expert runs on every token, weighted by
its routing weight (zero where not chosen), so that no shape depends on
the routing; at decode sizes the experts' weights are read once either
way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.step import capturing


@dataclass(frozen=True)
class Routing:
    """A family's routing rules; the defaults are a softmax over every
    expert, then the top-k, weights as they are."""

    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    top_k_first: bool = False  # the top-k logits first, then the softmax over those k
    renormalise: bool = False  # the chosen weights divided by their sum
    scale: float = 1.0  # the chosen weights times this
    bias: bool = False  # the logits' product has a bias
    # A score-correction bias added to the scores to choose the experts
    # (not to weigh them), the choice only within the `topk_group` of
    # `groups` groups of experts whose two best corrected scores sum highest.
    correction_bias: bool = False
    groups: int = 1
    topk_group: int = 1
    float32_product: bool = False  # the logits' product in float32, else in the model's dtype
    float32_scores: bool = True  # the scores in float32, else in the model's dtype
    float32_weights: bool = False  # the weights returned in float32, else in the model's dtype


class Router(nn.Module):
    """weights, chosen [tokens, top_k] for x [tokens, hidden], by `routing`'s
    rules. Parameters as the checkpoints name them: `weight` [experts,
    hidden], `bias`, `e_score_correction_bias`. It stays whole on every
    tensor-parallel rank, and outside the backends' swaps of Linear layers:
    its product is small, and its dtype is a rule."""

    def __init__(self, hidden: int, experts: int, routing: Routing):
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts)) if routing.bias else None  # (a plain None otherwise)
        if routing.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))

    def forward(self, x: torch.Tensor):
        r = self.routing
        if r.float32_product:
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        if r.float32_scores:
            logits = logits.float()
        if r.top_k_first:
            top, chosen = logits.topk(r.top_k, dim=-1)
            weights = self.score(top)
        else:
            scores = self.score(logits)
            if r.correction_bias:
                chosen = self.choose(scores + self.e_score_correction_bias.float())
                weights = scores.gather(1, chosen)
            else:
                weights, chosen = scores.topk(r.top_k, dim=-1)
        if r.renormalise:  # (+1e-20 leaves any sum of softmax scores as it is)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if r.scale != 1.0:
            weights = weights * r.scale
        return (weights if r.float32_weights else weights.to(x.dtype)), chosen

    def score(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=-1) if self.routing.scoring == "softmax" else torch.sigmoid(logits)

    def choose(self, choice: torch.Tensor) -> torch.Tensor:
        """The top-k experts by `choice`, within the best groups."""
        r = self.routing
        tokens, experts = choice.shape
        if r.groups > 1:
            by_group = choice.view(tokens, r.groups, experts // r.groups)
            best_groups = by_group.topk(2, dim=-1).values.sum(-1).topk(r.topk_group, dim=-1).indices
            allowed = torch.zeros(tokens, r.groups, dtype=torch.bool, device=choice.device)
            allowed.scatter_(1, best_groups, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(experts // r.groups, dim=1), float("-inf"))
        return choice.topk(r.top_k, dim=-1).indices


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
    for e in torch.unique(chosen).tolist():  # ascending, as transformers adds them
        token_idx, slot = torch.where(chosen == e)
        y = expert(e, x[token_idx]) * weights[token_idx, slot, None]
        # (index_put_ rather than index_add_: on the CPU index_add_ opens a parallel region even for a
        # few rows, 10-50 ms a call where other processes hold the cores, against microseconds.)
        out.index_put_((token_idx,), y.to(out.dtype), accumulate=True)
    return out
