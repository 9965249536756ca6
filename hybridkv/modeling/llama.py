"""Llama-style decoders: Llama, and Mistral / Ministral (sliding window on all
or some layers). RMSNorm `w * x`, RoPE, SiLU-gated MLP, scale head_dim ** -0.5.
The layer type of each layer comes from the KV specs (core/hf_config.py),
so Mistral-7B-v0.1 is a window-only model and Ministral can interleave.
A family of the same shape with another attention, mixer or feed-forward
(gpt-oss, Qwen3-Next) subclasses the model and builds its layers
(`decoder_layer`)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.decoder import DecoderParts
from ..layers.norm import RMSNorm
from ..layers.rotary import apply_rotary
from ..layers.step import StepBatch
from .stack import DecoderStack
from .sublayers import GatedMLP, PagedSelfAttention


class LlamaAttention(PagedSelfAttention):
    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        q, k, v = self.project(x)
        cos, sin = cos_sin
        return self.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, batch)


class LlamaDecoderLayer(nn.Module):
    """x += attention(norm(x)); x += feed_forward(norm(x)): Llama's
    attention and gated MLP unless given others."""

    def __init__(self, config, attention: nn.Module | None = None, mlp: nn.Module | None = None,
                 scale_in_float32: bool = False):
        super().__init__()
        self.self_attn = attention or LlamaAttention(config)
        self.mlp = mlp or GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, scale_in_float32=scale_in_float32)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                scale_in_float32=scale_in_float32)

    def parts(self) -> DecoderParts:
        return DecoderParts(self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm)

    def forward(self, x, cos_sin, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(DecoderStack):
    def decoder_layer(self, config, index: int) -> nn.Module:
        return LlamaDecoderLayer(config)
