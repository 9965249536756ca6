"""Llama-style decoders: Llama, and Mistral / Ministral (sliding window on all
or some layers). RMSNorm `w * x`, RoPE, SiLU-gated MLP, scale head_dim ** -0.5.
The layer type of each layer comes from the KV specs (core/hf_config.py),
so Mistral-7B-v0.1 is a window-only model and Ministral can interleave.
A family of the same shape with another attention, mixer or feed-forward
(gpt-oss, Qwen3-Next) subclasses the model and builds its layers
(`decoder_layer`)."""

from __future__ import annotations

from torch import nn

from .stack import DecoderStack
from .sublayers import GatedMLP, PagedSelfAttention


class LlamaForCausalLM(DecoderStack):
    def decoder_layer(self, config, index: int) -> nn.Module:
        mlp = GatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        return self.layer({"self_attn": PagedSelfAttention(config)}, {"mlp": mlp}, whole=True)
