"""The decoder stack every family shares: embeddings, the decoder layers,
a final RMS norm, the LM head (vocabulary-parallel, tied where the config
says), one rotary embedding or none. A family says, as data, what it names
them (`embedding`, `final_norm`, read from its checkpoints), how its final
norm scales (`unit_offset`, `scale_in_float32`), which config field holds
the norms' epsilon, and builds its layers (`decoder_layer`); its scalars
(an embedding multiplier, a logit scale or soft-cap) are the two hooks
`embed` and `compute_logits`.

Every decoder layer takes `(x, cos_sin, batch)`: `cos_sin` is None for a
family without rotary embeddings (`has_rotary`)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.parallel import VocabParallelHead
from ..layers.rotary import Rotary, inverse_frequencies
from ..layers.step import StepBatch
from .base import CausalLM


class DecoderStack(CausalLM):
    embedding = "embed_tokens"  # model.<embedding>: the token embeddings
    final_norm = "norm"  # model.<final_norm>
    eps = "rms_norm_eps"  # the config field of the norms' epsilon
    # the final norm's convention (layers/norm.py): Llama's `w * x`, in float32
    # before casting back where `scale_in_float32`, or Gemma's `(1 + w) * x` where `unit_offset`
    unit_offset = False
    scale_in_float32 = False

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        self.model = nn.Module()
        setattr(self.model, self.embedding, nn.Embedding(config.vocab_size, hidden))
        self.model.layers = nn.ModuleList(self.decoder_layers(config))
        setattr(self.model, self.final_norm, RMSNorm(hidden, getattr(config, self.eps), unit_offset=self.unit_offset,
                                                     scale_in_float32=self.scale_in_float32))
        self.lm_head = VocabParallelHead(hidden, config.vocab_size)
        self.tie_weights()
        self.rotary = Rotary(*inverse_frequencies(config)) if self.has_rotary(config) else None

    def has_rotary(self, config) -> bool:
        """Whether the layers take rotary embeddings (one, from the config)."""
        return True

    def decoder_layers(self, config) -> list[nn.Module]:
        """The stack's layers (by default `num_hidden_layers` of `decoder_layer`)."""
        return [self.decoder_layer(config, i) for i in range(config.num_hidden_layers)]

    def decoder_layer(self, config, index: int) -> nn.Module:
        """Layer `index` of the stack."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.tie(getattr(self.model, self.embedding))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (a family with a multiplier scales them here)."""
        return getattr(self.model, self.embedding)(input_ids)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        x = self.embed(batch.input_ids)
        cos_sin = None if self.rotary is None else self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos_sin, batch)
        return getattr(self.model, self.final_norm)(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
