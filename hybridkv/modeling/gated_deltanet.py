"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 (their `linear_attn`
layers), with Hugging Face parameter names.

Projections of the input: q and k (Hk key heads of K channels), v and the
output gate z (Hv value heads of V channels), and per value head b and a.
A depthwise causal conv over q, k and v (no bias) from the carried window,
SiLU; q and k L2-normalised per head, q scaled by K ** -0.5; beta =
sigmoid(b), the log decay g = -exp(A_log) softplus(a + dt_bias); the
gated delta rule per value head from the carried [K, V] state (the
backend's `GatedDeltaOps`: `step` / `prefill`; layers/
gated_delta_ops.py); each head's output RMS-normed over its V channels,
times the norm weight, times silu(z); out_proj.

The checkpoints store the projections two ways: Qwen3.5's `in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`; Qwen3-Next's `in_proj_qkvz` and
`in_proj_ba`, whose rows are grouped by key head (for each: its q, its k,
then the v and z of the value heads it serves; its b, then its a). After
loading both become one product (`fuse`) with the rows in the order the
forward splits: q, k, v, z, b, a.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.linear import Linear
from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks, leading_part
from ..layers.recurrent_state import padded_chunks
from ..layers.step import StepBatch
from .base import CacheLayer
from .mamba2 import GatedGroupRMSNorm


class GatedDeltaNet(CacheLayer, nn.Module):
    """A Gated DeltaNet layer over the paged recurrent state (module
    docstring). `grouped`: Qwen3-Next's two projections grouped by key
    head, else Qwen3.5's four."""

    def __init__(self, config, grouped: bool):
        nn.Module.__init__(self)
        hidden = config.hidden_size
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if v_heads % k_heads:
            raise ValueError(f"Gated DeltaNet needs linear_num_key_heads ({k_heads}) to divide "
                             f"linear_num_value_heads ({v_heads})")
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet layers with hidden_act {config.hidden_act!r} are not supported "
                             f"(SiLU only)")
        # Tensor parallelism (layers/parallel.py): a rank holds its share of
        # the key heads and of the value heads they serve (their rows of the
        # projections, conv channels, A_log, dt_bias; out_proj's columns),
        # so its conv window and states are those heads'. Qwen3-Next's
        # projections, grouped by key head, split into contiguous rows.
        self.ranks = ranks = current_ranks()
        self.k_heads, self.v_heads = k_heads // ranks.world, v_heads // ranks.world
        keys, values = k_heads * self.k_dim, v_heads * self.v_dim
        k_rows, v_rows = ranks.share(keys), ranks.share(values)
        self.v_head_rows = ranks.share(v_heads)
        self.conv_rows = [k_rows, slice(keys + k_rows.start, keys + k_rows.stop),
                          slice(2 * keys + v_rows.start, 2 * keys + v_rows.stop)]
        self.conv_dim = 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
        width = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, width, groups=self.conv_dim, bias=False,
                                padding=width - 1)
        self.grouped = grouped
        if grouped:
            self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * keys + 2 * values, bias=False)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * v_heads, bias=False)
        else:
            self.in_proj_qkv = ColumnParallelLinear(hidden, 2 * keys + values, bias=False, rows=self.conv_rows)
            self.in_proj_z = ColumnParallelLinear(hidden, values, bias=False)
            self.in_proj_b = ColumnParallelLinear(hidden, v_heads, bias=False)
            self.in_proj_a = ColumnParallelLinear(hidden, v_heads, bias=False)
        self.in_proj: Linear | None = None
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        # Per value head over its V channels: norm(o) * weight * silu(z).
        self.norm = GatedGroupRMSNorm(self.v_dim, 1, config.rms_norm_eps, gate_first=False)
        self.out_proj = RowParallelLinear(values, hidden, bias=False)

    def checkpoint_part(self, name: str, ndim: int):
        """The rank's value heads' A_log and dt_bias, its conv channels (the
        projections answer for themselves)."""
        if self.ranks.world == 1:
            return None
        if name in ("dt_bias", "A_log"):
            return (self.v_head_rows,)
        if name == "conv1d.weight":
            return leading_part(self.conv_rows, ndim)
        return None

    def fuse(self) -> None:
        """After loading: every input projection as one product, rows q, k,
        v, z, b, a."""
        if self.grouped:
            per = self.v_heads // self.k_heads  # value heads a key head serves
            qkvz = self.in_proj_qkvz.weight.data.view(self.k_heads, -1, self.in_proj_qkvz.in_features)
            q, k, v, z = qkvz.split([self.k_dim, self.k_dim, per * self.v_dim, per * self.v_dim], dim=1)
            ba = self.in_proj_ba.weight.data.view(self.k_heads, 2 * per, -1)
            b, a = ba.split([per, per], dim=1)
            rows = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]
            del self.in_proj_qkvz, self.in_proj_ba
        else:
            rows = [p.weight.data for p in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)]
            del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        weight = torch.cat(rows)
        self.in_proj = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.in_proj.weight = nn.Parameter(weight, requires_grad=False)

    def _heads(self, qkv: torch.Tensor):
        """Conv outputs [..., conv_dim] -> q, k [..., Hk, K] (L2-normalised,
        q scaled) and v [..., Hv, V]."""
        keys = self.k_heads * self.k_dim
        q, k, v = qkv.split([keys, keys, self.v_heads * self.v_dim], dim=-1)
        q, k = (t.unflatten(-1, (self.k_heads, self.k_dim)).float() for t in (q, k))
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * self.k_dim ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.unflatten(-1, (self.v_heads, self.v_dim))

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        meta = batch.recurrent[self.group]
        ops, name = self.ops, self.layer_name
        values = self.v_heads * self.v_dim
        qkv, z, b, a = self.in_proj(h).split([self.conv_dim, values, self.v_heads, self.v_heads], dim=-1)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0, :]
        o = torch.empty(h.shape[0], self.v_heads, self.v_dim, dtype=torch.float32, device=h.device)
        if meta.num_steps:  # one token for each of these sequences
            t = meta.step_tokens
            q, k, v = self._heads(ops.conv_step(meta, name, qkv[t], weight, None))
            o[t] = ops.step(meta, name, q, k, v, g[t], beta[t])
        for chunks, keep, saves in meta.passes:  # (verified chunks also keep each token's state)
            rows, tokens, lengths, valid = padded_chunks(chunks, h.device)
            q, k, v = self._heads(ops.conv_prefill(meta, name, rows, qkv[tokens], lengths, weight, None, keep))
            y = ops.prefill(meta, name, rows, q, k, v, g[tokens], beta[tokens], lengths, keep)
            o[tokens[valid]] = y[valid]
            if saves is not None:  # states at checkpoints inside chunks
                ops.save_states(meta, name, saves)
        o = self.norm(o, z.unflatten(-1, (self.v_heads, self.v_dim)))
        return self.out_proj(o.flatten(1).to(h.dtype))
