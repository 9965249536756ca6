"""Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`
and the language models of their multimodal checkpoints): Gated DeltaNet
layers (gated_deltanet.py) beside gated full attention, three of every
four layers linear by default (`layer_types`).

* Gated attention: q_proj gives each head its query and, beside it, an
  output gate of the same width; q and k RMS-normed per head; rotary
  embeddings on the first `partial_rotary_factor` (0.25) of each head; scale
  head_dim ** -0.5; the attended values times sigmoid(gate) before o_proj.
* RMS norms scale by (1 + w) (weights stored centred on 0), in float32,
  before both sublayers, on q and k, and at the end; the mixer's gated norm
  scales by w.
* Feed-forward: a mixture of experts (a softmax router over all experts,
  the top-k, their weights renormalised where `norm_topk_prob`; SiLU-gated
  experts stored as `experts.{e}.{gate,up,down}_proj`) plus a shared expert
  weighted by sigmoid(shared_expert_gate(x)); Qwen3-Next puts it on layers
  i with (i + 1) % decoder_sparse_step == 0 outside `mlp_only_layers` and a
  SiLU-gated MLP elsewhere; Qwen3.5 has the MLP on every layer, Qwen3.5-MoE
  the mixture.
* Qwen3.5's rotary embedding is multimodal (sections of the frequencies for
  time, height and width), which for text, whose three positions are the
  same, is the plain one.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.parallel import ColumnParallelLinear, current_ranks
from ..layers.rotary import apply_rotary
from ..layers.step import StepBatch
from .experts import Router, Routing, mix_experts
from .gated_deltanet import GatedDeltaNet
from .stack import DecoderStack
from .sublayers import GatedMLP, PagedSelfAttention


class GatedAttention(PagedSelfAttention):
    def __init__(self, config):
        super().__init__(config)
        bias = getattr(config, "attention_bias", False)
        # each head's query and gate side by side: a rank's heads are contiguous rows
        self.q_proj = ColumnParallelLinear(config.hidden_size, 2 * config.num_attention_heads * self.head_dim,
                                           bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        q_gate, k, v = self.project(x)
        q, gate = q_gate.chunk(2, dim=-1)  # per head: its query, then its gate
        cos, sin = cos_sin
        return self.attend(apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin), v, batch,
                           gate=gate)


class SparseMoE(nn.Module):
    """Tensor parallelism: the experts and the shared expert split by
    width, the router and the shared expert's gate whole; the partial sums
    reduced once."""

    def __init__(self, config):
        super().__init__()
        self.ranks = current_ranks()
        hidden, experts = config.hidden_size, config.num_experts
        self.gate = Router(hidden, experts, Routing(config.num_experts_per_tok,
                                                    renormalise=getattr(config, "norm_topk_prob", True)))
        self.experts = nn.ModuleList(GatedMLP(hidden, config.moe_intermediate_size, config.hidden_act, reduce=False)
                                     for _ in range(experts))
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size, config.hidden_act, reduce=False)
        self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x)
        out = mix_experts(x, weights, chosen, lambda e, rows: self.experts[e](rows), len(self.experts))
        return self.ranks.all_reduce(out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))


def is_moe_layer(config, index: int) -> bool:
    if getattr(config, "num_experts", 0) <= 0:
        return False  # Qwen3.5 (dense): its config has no experts
    step = getattr(config, "decoder_sparse_step", 1)
    return index not in (getattr(config, "mlp_only_layers", None) or ()) and (index + 1) % step == 0


class Qwen3NextForCausalLM(DecoderStack):
    """The shared stack (one rotary embedding) with this family's mixers and
    feed-forwards, and (1 + w) norms."""

    unit_offset = True
    grouped_projections = True  # Qwen3-Next's in_proj_qkvz / in_proj_ba
    unused_weights = ("mtp.",)  # the multi-token prediction layers (for speculative decoding)

    def __init__(self, config):
        unknown = sorted(set(config.layer_types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ValueError(f"{config.model_type}: layer types {unknown} are not supported")
        super().__init__(config)

    def decoder_layer(self, config, index: int) -> nn.Module:
        if config.layer_types[index] == "full_attention":
            mixer = {"self_attn": GatedAttention(config)}
        else:
            mixer = {"linear_attn": GatedDeltaNet(config, self.grouped_projections)}
        if is_moe_layer(config, index):
            return self.layer(mixer, {"mlp": SparseMoE(config)})
        return self.layer(mixer, {"mlp": GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)})


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    grouped_projections = False  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
    unused_weights = ("mtp.", "model.visual.")  # and the multimodal checkpoints' vision tower

