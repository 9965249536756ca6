"""Self-attention over the paged KV cache (Hugging Face parameter names),
which every decoder family here uses; the gated MLP beside it lives in
layers/mlp.py. The families add their norms, rotary embeddings or mixers
around them."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.mlp import GatedMLP
from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks
from ..layers.rotary import apply_rotary
from ..layers.step import StepBatch
from .base import CacheLayer

__all__ = ["GatedMLP", "PagedSelfAttention"]


class PagedSelfAttention(CacheLayer, nn.Module):
    """q/k/v/o projections around the paged cache. Families turn the
    projections into q, k (norms, rotary) and call `attend`.

    Tensor parallelism (layers/parallel.py): a rank computes its share of
    the query heads, and the KV heads likewise where there are at least as
    many as ranks, else the one KV head its query heads read (so its cache
    holds only those); o_proj takes the heads' columns and sums the ranks'
    products."""

    def __init__(self, config, scale: float | None = None, softcap: float | None = None):
        nn.Module.__init__(self)
        self.ranks = ranks = current_ranks()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = heads // ranks.world
        self.num_kv_heads = max(1, kv_heads // ranks.world)
        if kv_heads >= ranks.world:
            first_kv = ranks.rank * self.num_kv_heads
        else:
            first_kv = ranks.rank * self.num_heads // (heads // kv_heads)
        kv_rows = slice(first_kv * dim, (first_kv + self.num_kv_heads) * dim)
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, heads * dim, bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * dim, bias=bias, rows=kv_rows)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * dim, bias=bias, rows=kv_rows)
        self.o_proj = RowParallelLinear(heads * dim, hidden, bias=bias)
        self.qkv_proj: Linear | None = None
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.softcap = softcap
        # Attention sinks (gpt-oss): a learned logit per query head in each
        # softmax's denominator (backends/base.py AttentionOps.attend). A
        # family that has them sets a Parameter here; they cost no cache.
        self.register_parameter("sinks", None)
        # Over int8 pages: the keys stored less the layer's centre
        # (kv_quant.KeyCentre), bound by the worker where the scores meet
        # nothing but softmax (`centrable`); None: stored as they are.
        self.key_centre = None

    @property
    def centrable(self) -> bool:
        """Whether keys less a constant leave this layer's attention as it
        is: no softcap and no sinks see the scores (kv_quant.py)."""
        return not self.softcap and self.sinks is None

    def fuse(self) -> None:
        """After loading: q, k and v as one product (`qkv_proj`)."""
        self.qkv_proj = Linear.fused([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor):
        """q [tokens, heads, dim], k and v [tokens, kv_heads, dim]. (A family
        whose q_proj is wider, Qwen3-Next's with each head's output gate
        beside its query, gets q [tokens, heads, that width / heads].)"""
        tokens = x.shape[0]
        if self.qkv_proj is None:
            return (self.q_proj(x).view(tokens, self.num_heads, -1),
                    self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim),
                    self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim))
        kv = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.out_features - 2 * kv, kv, kv], dim=-1)
        return (q.view(tokens, self.num_heads, -1), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def attend(self, q, k, v, batch: StepBatch, gate: torch.Tensor | None = None) -> torch.Tensor:
        """The paged attention of q, k, v, then o_proj; with `gate` [tokens,
        heads, dim] (Qwen3-Next's output gate) the attended values are first
        multiplied by sigmoid(gate)."""
        meta = batch.attention[self.group]
        ops = self.ops
        if self.key_centre is not None:
            k = self.key_centre(k)
        if len(self.columns) == 1:
            cache = batch.buffers.attention_cache(self.layer_name)
            ops.store(cache, k, v, meta, self.column)
            attended = ops.attend(q, cache, meta, self.column, self.scale, self.softcap, self.sinks)
        else:
            attended = self.attend_pieces(q, k, v, batch, meta)
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return self.o_proj(attended.reshape(q.shape[0], -1))

    def attend_pieces(self, q, k, v, batch: StepBatch, meta) -> torch.Tensor:
        """The paged attention of a layer whose blocks the layout cuts by
        heads where a page ends (core/layout.py, `heads_per_page`), one store
        and one attention per piece: its KV heads and the query heads that
        read them."""
        group_size = self.num_heads // self.num_kv_heads
        out, first = [], 0
        for piece, (column, heads) in enumerate(zip(self.columns, self.piece_heads)):
            cache = batch.buffers.attention_cache(self.layer_name, piece)
            kv, qs = slice(first, first + heads), slice(first * group_size, (first + heads) * group_size)
            self.ops.store(cache, k[:, kv].contiguous(), v[:, kv].contiguous(), meta, column)
            sinks = None if self.sinks is None else self.sinks[qs]
            out.append(self.ops.attend(q[:, qs].contiguous(), cache, meta, column, self.scale, self.softcap, sinks))
            first += heads
        return torch.cat(out, dim=1)

    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        """Attention with the rotary embedding `cos_sin` on q and k, or
        none where it is None (Jamba, Nemotron-H)."""
        q, k, v = self.project(x)
        if cos_sin is not None:
            q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        return self.attend(q, k, v, batch)
