"""Llama-style decoders: Llama, and Mistral / Ministral (sliding window on all
or some layers). RMSNorm `w * x`, RoPE, SiLU-gated MLP, scale head_dim ** -0.5.
The layer type of each layer comes from the KV specs (core/hf_config.py),
so Mistral-7B-v0.1 is a window-only model and Ministral can interleave."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.batch import ForwardBatch
from ..layers.norm import RMSNorm
from ..layers.paged_attention import paged_attention, store_kv
from ..layers.rotary import Rotary, apply_rotary, inverse_frequencies
from .base import CacheLayer, CausalLM


class LlamaAttention(CacheLayer, nn.Module):
    def __init__(self, config):
        nn.Module.__init__(self)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos_sin, batch: ForwardBatch) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        meta = batch.attention[self.group]
        store_kv(self.cache, k, v, meta, self.column)
        return self.o_proj(paged_attention(q, self.cache, meta, self.column, self.scale).reshape(tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, batch):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        inv_freq, scaling = inverse_frequencies(config)
        self.rotary = Rotary(inv_freq, scaling)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
