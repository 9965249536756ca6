"""gpt-oss (OpenAI's open-weight MoE decoders) on the paged hybrid cache.

Layers alternate a 128-token sliding window and full attention
(`layer_types`), both with attention sinks: a learned logit per query
head that joins each softmax's denominator and weighs no value (the
backend's `attend(..., sinks)`; they cost no cache). Attention has q/k/v/o
biases, GQA, scale head_dim ** -0.5 and rotary embeddings (YaRN in the
released configs, through transformers' rope functions). RMSNorm scales
in float32 before casting back (transformers keeps these norms' weights
in float32). Every feed-forward is a mixture of experts: a router with a
bias picks the top-k experts by logit and weighs them by a softmax over
those k logits; an expert is `down(act(x W_gu + b_gu)) + b_d`, where the
gate and up columns of W_gu interleave (gate even, up odd) and
act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with
g = clamp(gate, max=limit). Parameter names follow the Hugging Face
checkpoints (experts stored stacked: `mlp.experts.gate_up_proj` [E,
hidden, 2 I], `down_proj` [E, I, hidden] and their biases).

Checkpoints in bf16 or float32 load; MXFP4-quantized ones (the released
weights' experts) do not, and are refused with the reason.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.parallel import current_ranks
from .experts import Router, Routing, mix_experts
from .stack import DecoderStack
from .sublayers import PagedSelfAttention


class GptOssAttention(PagedSelfAttention):
    """Llama's attention (rotary, biases from `attention_bias`) with a sink
    per query head (under tensor parallelism the rank's heads' sinks)."""

    def __init__(self, config):
        super().__init__(config)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.head_rows = self.ranks.share(config.num_attention_heads)

    def checkpoint_part(self, name: str, ndim: int):
        return (self.head_rows,) if name == "sinks" and self.ranks.world > 1 else None


class GptOssExperts(nn.Module):
    """The experts' weights, stacked as the checkpoints store them. Under
    tensor parallelism each expert is split by its width: a rank holds its
    share of the interleaved gate/up columns (whole pairs) and of down's
    rows, down's bias on rank 0 only (the sum has it once); its outputs are
    partial sums."""

    def __init__(self, config):
        super().__init__()
        self.ranks = ranks = current_ranks()
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        local = inter // ranks.world
        self.rows, self.pairs = ranks.share(inter), ranks.share(2 * inter)
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * local))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * local))
        self.down_proj = nn.Parameter(torch.zeros(experts, local, hidden))
        if ranks.rank == 0:
            self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        else:
            self.register_parameter("down_proj_bias", None)
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

    def checkpoint_part(self, name: str, ndim: int):
        if self.ranks.world == 1:
            return None
        return {"gate_up_proj": (slice(None), slice(None), self.pairs), "gate_up_proj_bias": (slice(None), self.pairs),
                "down_proj": (slice(None), self.rows)}.get(name)

    def forward(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e on rows x [rows, hidden]."""
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        activated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = activated @ self.down_proj[e]
        return out if self.down_proj_bias is None else out + self.down_proj_bias[e]


class GptOssMoE(nn.Module):
    """Router (with a bias) and experts: each token's top-k experts by
    router logit, weighted by a softmax over those k logits (in the model's
    dtype)."""

    def __init__(self, config):
        super().__init__()
        self.router = Router(config.hidden_size, config.num_local_experts, Routing(
            config.num_experts_per_tok, top_k_first=True, bias=True, float32_scores=False))
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x)
        out = mix_experts(x, weights, chosen, lambda e, rows: self.experts(rows, e),
                          self.experts.gate_up_proj.shape[0])
        return self.experts.ranks.all_reduce(out)


class GptOssForCausalLM(DecoderStack):
    """Llama's decoder shape: x += attention(norm(x)); x += MoE(norm(x)),
    with this family's attention, experts and norms. The layers' `parts()`
    name a mixture-of-experts feed-forward, which a backend running whole
    layers may decline (and says so in its prepare report)."""

    scale_in_float32 = True

    def __init__(self, config):
        quantization = getattr(config, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        if method is not None:
            raise ValueError(f"gpt-oss checkpoints quantized with {method!r} are not supported: hybridkv loads "
                             f"bf16 or float32 weights (a dequantized checkpoint)")
        super().__init__(config)

    def decoder_layer(self, config, index: int) -> nn.Module:
        return self.layer({"self_attn": GptOssAttention(config)}, {"mlp": GptOssMoE(config)}, whole=True)
