"""Nemotron-H: a stack of blocks, each one mixer after an RMS norm with a
residual around it; the block's type comes from `layers_block_type` (or the
older `hybrid_override_pattern`: M, *, -, E):

* Mamba-2 ("linear_attention", M): mamba2.py's mixer, dt clamped from below
  at `time_step_min` (transformers' Nemotron-H mixer does so);
* attention ("full_attention", *): no positional encoding, scale
  head_dim ** -0.5;
* MLP ("mlp", -): down(relu(up(x))^2), not gated;
* mixture of experts ("moe", E; Nemotron-3 Nano): a sigmoid router with a
  score-correction bias choosing top-k experts within the best groups,
  weights renormalised and scaled, experts of the MLP's form (optionally in
  a latent space), and a shared expert beside them.

The checkpoints name the stack `backbone.` (read as `model.`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks
from .experts import Router, Routing, mix_experts
from .mamba2 import Mamba2Mixer
from .stack import DecoderStack, LayerNorms
from .sublayers import PagedSelfAttention

BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def block_types(config) -> list[str]:
    types = getattr(config, "layers_block_type", None)
    if types:
        return list(types)
    return [BLOCK_TYPES[c] for c in config.hybrid_override_pattern]


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2); under tensor parallelism split by its width
    (up by rows, down by columns), down's partial sums left to the caller
    where `reduce` is False."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, reduce: bool = True):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce=reduce)

    def forward(self, x):
        return self.down_proj(relu2(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """Tensor parallelism: every expert and the shared expert split by
    width, the router and the latent projections whole; the experts'
    partial sums are reduced once (in the latent space where there is one,
    before its projection back), the shared expert's with them."""

    def __init__(self, config):
        super().__init__()
        self.ranks = current_ranks()
        latent = getattr(config, "moe_latent_size", None)
        width = latent or config.hidden_size
        # sigmoid scores; the experts chosen by the corrected scores within the best groups
        self.gate = Router(config.hidden_size, config.n_routed_experts, Routing(
            config.num_experts_per_tok, scoring="sigmoid", renormalise=config.norm_topk_prob,
            scale=config.routed_scaling_factor, correction_bias=True, groups=config.n_group,
            topk_group=config.topk_group, float32_product=True, float32_weights=True))
        self.experts = nn.ModuleList(ReluSquaredMLP(width, config.moe_intermediate_size, config.mlp_bias, reduce=False)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = ReluSquaredMLP(config.hidden_size, config.moe_shared_expert_intermediate_size,
                                             config.mlp_bias, reduce=latent is not None)
        if latent is not None:
            self.fc1_latent_proj = Linear(config.hidden_size, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = Linear(latent, config.hidden_size, bias=config.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x):
        weights, chosen = self.gate(x)
        inner = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = mix_experts(inner, weights, chosen, lambda e, rows: self.experts[e](rows), len(self.experts),
                          dtype=torch.float32).to(x.dtype)
        if self.fc2_latent_proj is not None:
            return self.fc2_latent_proj(self.ranks.all_reduce(out)) + self.shared_experts(x)
        return self.ranks.all_reduce(out + self.shared_experts(x))


def nemotron_mamba(config) -> Mamba2Mixer:
    return Mamba2Mixer(
        config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups, config.ssm_state_size,
        config.conv_kernel, conv_bias=config.use_conv_bias, in_bias=config.use_bias, out_bias=config.use_bias,
        eps=config.layer_norm_epsilon, dt_limit=(config.time_step_min, float("inf")),
        activation=config.mamba_hidden_act)


class NemotronHForCausalLM(DecoderStack):
    embedding = "embeddings"
    final_norm = "norm_f"
    eps = "layer_norm_epsilon"

    def __init__(self, config):
        activation = getattr(config, "mlp_hidden_act", "relu2")
        if activation != "relu2":
            raise ValueError(f"Nemotron-H with mlp_hidden_act {activation!r} is not supported (relu2 only)")
        super().__init__(config)

    def has_rotary(self, config) -> bool:
        return False  # attention without positional encoding

    norms = LayerNorms(input="norm", pre_mlp="norm")  # a block is a mixer or a feed-forward

    def decoder_layers(self, config) -> list[nn.Module]:
        return [self.block(config, t) for t in block_types(config)]

    def block(self, config, block_type: str) -> nn.Module:
        if block_type == "linear_attention":
            return self.layer({"mixer": nemotron_mamba(config)}, {})
        if block_type == "full_attention":
            return self.layer({"mixer": PagedSelfAttention(config)}, {})  # no positional encoding
        if block_type == "mlp":
            return self.layer({}, {"mixer": ReluSquaredMLP(config.hidden_size, config.intermediate_size,
                                                           config.mlp_bias)})
        if block_type == "moe":
            return self.layer({}, {"mixer": NemotronHMoE(config)})
        raise ValueError(f"Nemotron-H block type {block_type!r} is not supported")
