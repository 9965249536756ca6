"""Bamba: Mamba-2 layers (mamba2.py) and attention layers, each followed by
a SiLU-gated MLP, Jamba's pre-norm layout (`input_layernorm`,
`pre_ff_layernorm`). Attention rotates only the first part of each head
(`partial_rotary_factor`, 0.5 in every Bamba config), scale
head_dim ** -0.5. Which layers attend: `attn_layer_indices`."""

from __future__ import annotations

from torch import nn

from ..layers.norm import RMSNorm
from .llama import LlamaAttention
from .mamba2 import mamba2_mixer
from .stack import DecoderStack
from .sublayers import GatedMLP


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


class BambaForCausalLM(DecoderStack):
    final_norm = "final_layernorm"

    def decoder_layer(self, config, index: int) -> nn.Module:
        return BambaDecoderLayer(config, index in attention_layers(config))
