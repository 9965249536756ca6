"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side
on the same normed input and adds both to the residual, then a SiLU-gated
MLP. Its cache is two layers per decoder layer: the attention's K/V
(`model.layers.{i}`) and the mixer's state (`model.layers.{i}.mamba`).

muP-style scalars, all from the config: embeddings times
`embedding_multiplier`; the mixer's input times `ssm_in_multiplier`, its
in_proj output times one factor per part (z, x, B, C, dt:
`ssm_multipliers`), its output times `ssm_out_multiplier`; the attention's
input times `attention_in_multiplier`, its keys times `key_multiplier`,
its output times `attention_out_multiplier`; the MLP's gate before the
activation times `mlp_multipliers[0]`, its output times
`mlp_multipliers[1]`; logits times `lm_head_multiplier`. The mixer's gate
is a grouped RMS norm only where `mamba_rms_norm` says so (normalising
before the gate where `mamba_norm_before_gate`), else `y * silu(z)`."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.rotary import apply_rotary
from ..layers.step import StepBatch
from .base import CacheLayer
from .mamba2 import Mamba2Mixer, mamba2_mixer
from .stack import DecoderStack, LayerNorms
from .sublayers import GatedMLP, PagedSelfAttention


def in_proj_scale(config, inner: int) -> torch.Tensor:
    """The per-channel factor of the mixer's in_proj output: z and x are
    `inner` wide, B and C groups x state, dt one per head."""
    bc = config.mamba_n_groups * config.mamba_d_state
    widths = (inner, inner, bc, bc, config.mamba_n_heads)
    return torch.cat([torch.full((w,), float(m), device="cpu") for w, m in zip(widths, config.ssm_multipliers)])


class FalconH1Attention(PagedSelfAttention):
    """Attention with its keys scaled before the rotary embedding."""

    def __init__(self, config):
        super().__init__(config)
        self.key_multiplier = config.key_multiplier

    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        q, k, v = self.project(x)
        cos, sin = cos_sin
        return self.attend(apply_rotary(q, cos, sin), apply_rotary(k * self.key_multiplier, cos, sin), v, batch)


class FalconH1MLP(GatedMLP):
    def __init__(self, config):
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def activated(self, x):
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.act(gate * self.gate_multiplier) * up

    def forward(self, x):
        return self.down_proj(self.activated(x)) * self.down_multiplier


class FalconH1ForCausalLM(DecoderStack):
    final_norm = "final_layernorm"
    norms = LayerNorms(pre_mlp="pre_ff_layernorm")

    def decoder_layer(self, config, index: int) -> nn.Module:
        inner = config.mamba_d_ssm or config.mamba_expand * config.hidden_size
        norm = ("gated_after" if config.mamba_norm_before_gate else "gated") if config.mamba_rms_norm else None
        mamba = mamba2_mixer(config, inner, out_bias=config.projectors_bias, norm=norm,
                             in_scale=in_proj_scale(config, inner))
        c = config
        scales = {"mamba": (c.ssm_in_multiplier, c.ssm_out_multiplier),
                  "self_attn": (c.attention_in_multiplier, c.attention_out_multiplier)}
        return self.layer({"mamba": mamba, "self_attn": FalconH1Attention(config)},
                          {"feed_forward": FalconH1MLP(config)}, scales=scales)

    def cache_layers(self) -> dict[str, CacheLayer]:
        """Two per decoder layer: its attention under the layer's name, its
        mixer under its own (`model.layers.{i}.mamba`: core/hf_config.py)."""
        return {(name if isinstance(module, Mamba2Mixer) else name.rsplit(".", 1)[0]): module
                for name, module in self.named_modules() if isinstance(module, CacheLayer)}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) * self.config.lm_head_multiplier).float()
