"""Gemma-3 (text) and Gemma-2 on the paged hybrid cache.

Gemma-3: embeddings scaled by sqrt(hidden) (rounded to the weight dtype, as
transformers does), Gemma RMSNorm `x * (1 + w)` in float32 around both
sublayers, q/k RMSNorm before RoPE, scale `query_pre_attn_scalar ** -0.5`,
RoPE base per layer type (local for sliding layers), GELU-tanh MLP, final
logit soft-capping when configured. transformers 5.23 stores
`attn_logit_softcapping` for Gemma-3 but does not apply it; we match it.
Gemma-2 is the same without q/k norms and with attention soft-capping.
Parameter names follow the Hugging Face checkpoints.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary, inverse_frequencies
from ..layers.step import StepBatch
from .stack import DecoderStack, LayerNorms
from .sublayers import GatedMLP, PagedSelfAttention


class GemmaAttention(PagedSelfAttention):
    def __init__(self, config, qk_norm: bool, softcap: float | None):
        super().__init__(config, scale=config.query_pre_attn_scalar ** -0.5, softcap=softcap)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.qk_norm = qk_norm

    def forward(self, x: torch.Tensor, cos_sin, batch: StepBatch) -> torch.Tensor:
        if not self.qk_norm:
            return super().forward(x, cos_sin, batch)
        q, k, v = self.project(x)
        cos, sin = cos_sin
        return self.attend(self.q_norm.rotated(q, cos, sin), self.k_norm.rotated(k, cos, sin), v, batch)


class GemmaForCausalLM(DecoderStack):
    """Gemma-3 text (`qk_norm`) or Gemma-2 (without): embeddings times
    sqrt(hidden), a rotary embedding per layer type, logits soft-capped."""

    # the multimodal Gemma-3's vision tower, in the older layout and in transformers 5's
    unused_weights = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
    unit_offset = True
    norms = LayerNorms(pre_mlp="pre_feedforward_layernorm", post_mixer="post_attention_layernorm",
                       post_mlp="post_feedforward_layernorm")
    qk_norm = True

    def __init__(self, config):
        super().__init__(config)
        self.layer_types = list(config.layer_types)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.rotary = {}
        for layer_type in set(self.layer_types):
            inv_freq, scaling = inverse_frequencies(config, layer_type if self.qk_norm else None, config.head_dim)
            self.rotary[layer_type] = Rotary(inv_freq, scaling)
        self.embed_scale = config.hidden_size ** 0.5

    def has_rotary(self, config) -> bool:
        return False  # one per layer type, built above

    def decoder_layer(self, config, index: int) -> nn.Module:
        softcap = None if self.qk_norm else getattr(config, "attn_logit_softcapping", None)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        return self.layer({"self_attn": GemmaAttention(config, self.qk_norm, softcap)},
                          {"mlp": GatedMLP(config.hidden_size, config.intermediate_size, act)}, whole=True)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight  # the scale rounded to the weights' dtype, as transformers does
        return self.model.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        cos_sin = {t: r.cos_sin(batch.positions, x.dtype) for t, r in self.rotary.items()}
        for layer, layer_type in zip(self.model.layers, self.layer_types):
            x = layer(x, cos_sin[layer_type], batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # (the model's dtype where nothing follows: modeling/base.py)
        if self.final_softcap:
            logits = torch.tanh(logits.float() / self.final_softcap) * self.final_softcap
        return logits


class Gemma2ForCausalLM(GemmaForCausalLM):
    qk_norm = False
