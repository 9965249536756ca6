"""Bamba: Mamba-2 layers (mamba2.py) and attention layers, each followed by
a SiLU-gated MLP, Jamba's pre-norm layout (`input_layernorm`,
`pre_ff_layernorm`). Attention rotates only the first part of each head
(`partial_rotary_factor`, 0.5 in every Bamba config), scale
head_dim ** -0.5. Which layers attend: `attn_layer_indices`."""

from __future__ import annotations

from torch import nn

from .mamba2 import mamba2_mixer
from .stack import DecoderStack, LayerNorms
from .sublayers import GatedMLP, PagedSelfAttention


class BambaForCausalLM(DecoderStack):
    final_norm = "final_layernorm"
    norms = LayerNorms(pre_mlp="pre_ff_layernorm")

    def decoder_layer(self, config, index: int) -> nn.Module:
        if index in set(config.attn_layer_indices or ()):
            mixer = {"self_attn": PagedSelfAttention(config)}
        else:
            mixer = {"mamba": mamba2_mixer(config)}
        return self.layer(mixer, {"feed_forward": GatedMLP(config.hidden_size, config.intermediate_size,
                                                           config.hidden_act)})
