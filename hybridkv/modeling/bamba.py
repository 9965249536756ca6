"""Bamba: Mamba-2 layers (mamba2.py) and attention layers, each followed by
a SiLU-gated MLP, Jamba's pre-norm layout (`input_layernorm`,
`pre_ff_layernorm`). Attention rotates only the first part of each head
(`partial_rotary_factor`, 0.5 in every Bamba config), scale
head_dim ** -0.5. Which layers attend: `attn_layer_indices`."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.parallel import VocabParallelHead
from ..layers.rotary import Rotary, inverse_frequencies
from ..layers.step import StepBatch
from .base import CausalLM
from .llama import LlamaAttention
from .mamba2 import Mamba2Mixer
from .sublayers import GatedMLP


def mamba2_mixer(config, intermediate: int | None = None, **options) -> Mamba2Mixer:
    """The Mamba-2 mixer as the configs that name it `mamba_*` describe it
    (Bamba, Granite-4.0-H, Falcon-H1)."""
    heads = config.mamba_n_heads
    inner = intermediate or config.mamba_expand * config.hidden_size
    head_dim = config.mamba_d_head if isinstance(config.mamba_d_head, int) else inner // heads
    options.setdefault("out_bias", config.mamba_proj_bias)
    return Mamba2Mixer(config.hidden_size, heads, head_dim, config.mamba_n_groups, config.mamba_d_state,
                       config.mamba_d_conv, conv_bias=config.mamba_conv_bias, in_bias=config.mamba_proj_bias,
                       eps=config.rms_norm_eps, dt_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
                       activation=config.hidden_act, **options)


def attention_layers(config) -> set[int]:
    return set(config.attn_layer_indices or ())


class BambaDecoderLayer(nn.Module):
    def __init__(self, config, is_attention: bool):
        super().__init__()
        if is_attention:
            self.self_attn = LlamaAttention(config)
        else:
            self.mamba = mamba2_mixer(config)
        self.is_attention = is_attention
        self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, batch):
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cos_sin, batch) if self.is_attention else self.mamba(h, batch))
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config)
        attention = attention_layers(config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(BambaDecoderLayer(config, i in attention)
                                          for i in range(config.num_hidden_layers))
        self.model.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size)
        self.tie_weights()
        self.rotary = Rotary(*inverse_frequencies(config))

    def forward(self, batch: StepBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, batch)
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
