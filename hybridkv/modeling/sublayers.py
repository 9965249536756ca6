"""Self-attention over the paged KV cache (Hugging Face parameter names),
which every decoder family here uses; the gated MLP beside it lives in
layers/mlp.py. The families add their norms, rotary embeddings or mixers
around them."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.mlp import GatedMLP
from ..layers.step import StepBatch
from .base import CacheLayer

__all__ = ["GatedMLP", "PagedSelfAttention"]


class PagedSelfAttention(CacheLayer, nn.Module):
    """q/k/v/o projections around the paged cache. Families turn the
    projections into q, k (norms, rotary) and call `attend`."""

    reduce = None  # as GatedMLP's: the split output projection's partial sums

    def __init__(self, config, scale: float | None = None, softcap: float | None = None):
        nn.Module.__init__(self)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.qkv_proj: Linear | None = None
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        # Attention sinks (gpt-oss): a learned logit per query head in each
        # softmax's denominator (backends/base.py AttentionOps.attend). A
        # family that has them sets a Parameter here; they cost no cache.
        self.register_parameter("sinks", None)

    def fuse(self) -> None:
        """After loading: q, k and v as one product (`qkv_proj`)."""
        self.qkv_proj = Linear.fused([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor):
        """q [tokens, heads, dim], k and v [tokens, kv_heads, dim]."""
        tokens = x.shape[0]
        if self.qkv_proj is None:
            return (self.q_proj(x).view(tokens, self.num_heads, self.head_dim),
                    self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim),
                    self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        kv = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def attend(self, q, k, v, batch: StepBatch) -> torch.Tensor:
        meta = batch.attention[self.group]
        ops = self.ops
        cache = batch.buffers.attention_cache(self.layer_name)
        ops.store(cache, k, v, meta, self.column)
        attended = ops.attend(q, cache, meta, self.column, self.scale, self.softcap, self.sinks)
        out = self.o_proj(attended.reshape(q.shape[0], -1))
        return out if self.reduce is None else self.reduce(out)

    def forward(self, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        return self.attend(*self.project(x), batch)
