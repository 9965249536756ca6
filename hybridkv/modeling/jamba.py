"""Jamba: Mamba and attention layers, MLP and MoE feed-forwards.

Attention layers have no positional encoding (the Mamba layers carry
order), scale head_dim ** -0.5. RMSNorm is `w * x` (Llama style). The Mamba
mixer: in_proj -> (x, gate); depthwise causal conv over x with the carried
conv state, SiLU; x_proj -> (dt, B, C), each RMS-normed; dt_proj (its bias
added before softplus); selective scan from the carried SSM state with
A = -exp(A_log); y + D * x, gated by SiLU(gate); out_proj. MoE: softmax
router, top-k experts, weights not renormalised. Parameter names follow
the Hugging Face checkpoints (experts.{e}.{gate,up,down}_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks, leading_part
from ..layers.recurrent_state import padded_chunks
from ..layers.step import StepBatch
from .base import CacheLayer
from .experts import Router, Routing, mix_experts
from .stack import DecoderStack, LayerNorms
from .sublayers import GatedMLP, PagedSelfAttention


class JambaMamba(CacheLayer, nn.Module):
    """Tensor parallelism (layers/parallel.py): a rank holds its share of
    the channels: in_proj's rows of them (of x, then of the gate), their
    conv, dt_proj rows, A and D, so its conv and SSM states are its
    channels'; x_proj and out_proj take the channels' columns and sum the
    ranks' products (x_proj's, dt and B and C, is small)."""

    # Parameters indexed by channel (first dimension), read as the rank's channels.
    CHANNEL_PARAMETERS = ("A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias")

    def __init__(self, config):
        nn.Module.__init__(self)
        hidden = config.hidden_size
        self.ranks = ranks = current_ranks()
        inner = config.mamba_expand * hidden
        self.channels = ranks.share(inner)
        self.inner = inner // ranks.world
        self.state_size = config.mamba_d_state
        self.conv_width = config.mamba_d_conv
        self.dt_rank = config.mamba_dt_rank
        gate = slice(inner + self.channels.start, inner + self.channels.stop)
        self.in_proj = ColumnParallelLinear(hidden, 2 * inner, bias=config.mamba_proj_bias,
                                            rows=[self.channels, gate])
        self.conv1d = nn.Conv1d(self.inner, self.inner, self.conv_width, groups=self.inner,
                                bias=config.mamba_conv_bias, padding=self.conv_width - 1)
        self.x_proj = RowParallelLinear(inner, self.dt_rank + 2 * self.state_size, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.state_size))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = RowParallelLinear(inner, hidden, bias=config.mamba_proj_bias)
        eps = config.rms_norm_eps
        self.dt_layernorm = RMSNorm(self.dt_rank, eps)
        self.b_layernorm = RMSNorm(self.state_size, eps)
        self.c_layernorm = RMSNorm(self.state_size, eps)

    def checkpoint_part(self, name: str, ndim: int):
        """The rank's channels of the channel-indexed parameters (the
        projections answer for themselves)."""
        if self.ranks.world == 1 or name not in self.CHANNEL_PARAMETERS:
            return None
        return leading_part(self.channels, ndim)

    def _ssm_inputs(self, x: torch.Tensor):
        """dt (after bias and softplus, float32), B, C from conv outputs x [L, I]."""
        projected = self.x_proj(x)
        dt, B, C = torch.split(projected, [self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.t()
        dt = F.softplus(dt.float() + self.dt_proj.bias.float())
        return dt, self.b_layernorm(B), self.c_layernorm(C)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        meta = batch.recurrent[self.group]
        ops = self.ops
        xz = self.in_proj(h)
        x_all, gate_all = xz[:, :self.inner], xz[:, self.inner:]
        weight = self.conv1d.weight[:, 0, :]
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        y_all = torch.empty(h.shape[0], self.inner, dtype=torch.float32, device=h.device)
        if meta.num_steps:  # one token for each of these sequences: the state ops of the backend
            tokens = meta.step_tokens
            x = ops.conv_step(meta, self.layer_name, x_all[tokens], weight, self.conv1d.bias)
            dt, B, C = self._ssm_inputs(x)
            y_all[tokens] = ops.step(meta, self.layer_name, x, dt, A, B, C, D, gate_all[tokens])
        # Chunks of several tokens, side by side (those that verify drafts
        # also keep each token's state); states at checkpoints inside them
        # saved after the pass that ends there.
        for chunks, keep, saves in meta.passes:
            self._chunks(meta, chunks, x_all, gate_all, weight, A, D, y_all, keep)
            if saves is not None:
                ops.save_states(meta, self.layer_name, saves)
        return self.out_proj(y_all.to(h.dtype))

    def _chunks(self, meta, chunks, x_all, gate_all, weight, A, D, y_all, keep=False):
        ops = self.ops
        rows, tokens, lengths, valid = padded_chunks(chunks, x_all.device)
        x = ops.conv_prefill(meta, self.layer_name, rows, x_all[tokens], lengths, weight, self.conv1d.bias, keep)
        dt, B, C = self._ssm_inputs(x)
        y = ops.prefill(meta, self.layer_name, rows, x, dt, A, B, C, lengths, keep)
        gate = gate_all[tokens].float()
        y_all[tokens[valid]] = ((y + x.float() * D) * F.silu(gate))[valid]


class JambaMoE(nn.Module):
    """Tensor parallelism: every expert's MLP split by its width, the
    router whole on every rank; the experts' partial sums are summed here,
    then reduced once for all of them."""

    def __init__(self, config):
        super().__init__()
        self.ranks = current_ranks()
        self.router = Router(config.hidden_size, config.num_experts, Routing(config.num_experts_per_tok))
        self.experts = nn.ModuleList(GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                              reduce=False)
                                     for _ in range(config.num_experts))

    def forward(self, x):
        weights, chosen = self.router(x)
        out = mix_experts(x, weights, chosen, lambda e, rows: self.experts[e](rows), len(self.experts))
        return self.ranks.all_reduce(out)


class JambaForCausalLM(DecoderStack):
    final_norm = "final_layernorm"
    norms = LayerNorms(pre_mlp="pre_ff_layernorm")

    def has_rotary(self, config) -> bool:
        return False  # the Mamba layers carry order

    def decoder_layer(self, config, index: int) -> nn.Module:
        if index % config.attn_layer_period == config.attn_layer_offset:
            mixer = {"self_attn": PagedSelfAttention(config)}  # no positional encoding
        else:
            mixer = {"mamba": JambaMamba(config)}
        if config.num_experts > 1 and index % config.expert_layer_period == config.expert_layer_offset:
            return self.layer(mixer, {"feed_forward": JambaMoE(config)})
        return self.layer(mixer, {"feed_forward": GatedMLP(config.hidden_size, config.intermediate_size,
                                                           config.hidden_act)})
