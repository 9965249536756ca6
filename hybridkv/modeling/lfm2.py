"""LFM2: gated short-convolution layers beside GQA attention, each followed
by a SiLU-gated MLP, RMS norms before both (`operator_norm`, `ffn_norm`)
and a final one (`embedding_norm`).

The short convolution (`ShortConv`): in_proj -> (b, c, x), three
hidden-wide parts; a depthwise causal conv of width `conv_L_cache` over
b * x, from the carried window, with no activation; times c; out_proj.
Its state is the window alone (the L_cache - 1 inputs b * x before the next
token); the backend's `ShortConvOps` (`step` / `prefill`) move it on.
Attention normalises q and k per head before RoPE; scale head_dim ** -0.5.
The MLP's width is `block_ff_dim` adjusted as the config says (2/3 of it,
times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks, leading_part
from ..layers.recurrent_state import padded_chunks
from ..layers.rotary import apply_rotary
from ..layers.step import StepBatch
from .base import CacheLayer
from .stack import DecoderStack, LayerNorms
from .sublayers import GatedMLP, PagedSelfAttention


def mlp_width(config) -> int:
    width = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            multiple = config.block_multiple_of
            width = multiple * ((width + multiple - 1) // multiple)
    return width


class ShortConv(CacheLayer, nn.Module):
    """Tensor parallelism (layers/parallel.py): a rank holds its share of
    the channels (their b, c and x rows of in_proj, their conv; out_proj's
    columns), so its window is those channels'."""

    def __init__(self, config):
        nn.Module.__init__(self)
        hidden, width, bias = config.hidden_size, config.conv_L_cache, config.conv_bias
        self.ranks = ranks = current_ranks()
        self.channels = share = ranks.share(hidden)
        self.hidden = local = hidden // ranks.world
        self.conv = nn.Conv1d(local, local, width, groups=local, bias=bias, padding=width - 1)
        rows = [slice(part * hidden + share.start, part * hidden + share.stop) for part in range(3)]
        self.in_proj = ColumnParallelLinear(hidden, 3 * hidden, bias=bias, rows=rows)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)

    def checkpoint_part(self, name: str, ndim: int):
        if self.ranks.world == 1 or name not in ("conv.weight", "conv.bias"):
            return None
        return leading_part(self.channels, ndim)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        meta = batch.recurrent[self.group]
        ops, name = self.ops, self.layer_name
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        weight, bias = self.conv.weight[:, 0, :], self.conv.bias
        y = torch.empty_like(x)
        if meta.num_steps:
            t = meta.step_tokens
            y[t] = ops.step(meta, name, b[t], c[t], x[t], weight, bias)
        for chunks, keep, saves in meta.passes:  # (verified chunks also keep their windows)
            rows, tokens, lengths, valid = padded_chunks(chunks, h.device)
            out = ops.prefill(meta, name, rows, b[tokens], c[tokens], x[tokens], lengths, weight,
                                         bias, keep)
            y[tokens[valid]] = out[valid].to(y.dtype)
            if saves is not None:  # windows at checkpoints inside chunks
                ops.save_states(meta, name, saves)
        return self.out_proj(y)


class Lfm2Attention(PagedSelfAttention):
    def __init__(self, config):
        super().__init__(config)
        self.q_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        q, k, v = self.project(x)
        cos, sin = cos_sin
        return self.attend(apply_rotary(self.q_layernorm(q), cos, sin), apply_rotary(self.k_layernorm(k), cos, sin),
                           v, batch)


class Lfm2ForCausalLM(DecoderStack):
    final_norm = "embedding_norm"
    eps = "norm_eps"
    norms = LayerNorms(input="operator_norm", pre_mlp="ffn_norm")
    # checkpoint names -> ours (the MLP as w1/w3/w2, attention's output as out_proj)
    RENAMES = ((".feed_forward.w1.", ".feed_forward.gate_proj."), (".feed_forward.w3.", ".feed_forward.up_proj."),
               (".feed_forward.w2.", ".feed_forward.down_proj."), (".self_attn.out_proj.", ".self_attn.o_proj."))

    def decoder_layer(self, config, index: int) -> nn.Module:
        if config.layer_types[index] == "conv":
            mixer = {"conv": ShortConv(config)}
        else:
            mixer = {"self_attn": Lfm2Attention(config)}
        return self.layer(mixer, {"feed_forward": GatedMLP(config.hidden_size, mlp_width(config), "silu")})

    def weight_name(self, checkpoint_name: str) -> str | None:
        for old, new in self.RENAMES:
            checkpoint_name = checkpoint_name.replace(old, new)
        return checkpoint_name
