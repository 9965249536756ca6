"""The decoder stack every family shares: embeddings, the decoder layers,
a final RMS norm, the LM head (vocabulary-parallel, tied where the config
says), one rotary embedding or none. A family says, as data, what it names
them (`embedding`, `final_norm`, read from its checkpoints), how its norms
scale (`unit_offset`, `scale_in_float32`), which config field holds the
norms' epsilon, what its layers name their norms (`norms`), and which
mixers and feed-forwards each layer has (`decoder_layer`, through
`layer`); its scalars (an embedding multiplier, a logit scale or soft-cap)
are the two hooks `embed` and `compute_logits`.

The decoder layer is one class, `DecoderLayer`: pre-norm mixers (one, or
several side by side whose outputs add up: Falcon-H1's attention and
Mamba-2) with a residual, then pre-norm feed-forwards (an MLP, a mixture
of experts, or both added up) with a residual, each branch optionally
normed after (Gemma) and scaled (Granite). Every decoder layer takes
`(x, cos_sin, batch)`: `cos_sin` is None for a family without rotary
embeddings (`has_rotary`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.decoder import DecoderParts
from ..layers.norm import RMSNorm
from ..layers.parallel import VocabParallelHead, current_ranks
from ..layers.rotary import Rotary, inverse_frequencies
from ..layers.step import StepBatch
from .base import CausalLM
from .sublayers import PagedSelfAttention


@dataclass(frozen=True)
class LayerNorms:
    """What a family's decoder layers name their RMS norms (the
    checkpoints' names); None: the family has no such norm."""

    input: str | None = "input_layernorm"  # before the mixers
    pre_mlp: str | None = "post_attention_layernorm"  # before the feed-forwards
    post_mixer: str | None = None  # on the mixers' output, before the residual add
    post_mlp: str | None = None  # on the feed-forwards' output, before the residual add


class DecoderLayer(nn.Module):
    """x += post_mixer(sum of out_m * m(in_m * input(x))) * residual;
    x += post_mlp(sum of f(pre_mlp(x))) * residual, over the mixers m and
    the feed-forwards f it is given (by name: the checkpoints'), either
    side possibly empty (a Nemotron-H block is a mixer or a feed-forward).
    Attention mixers take the rotary `cos_sin`, recurrent ones the batch.

    `scales`: a mixer's (input, output) factors (Falcon-H1); `residual`:
    both branches' factor (Granite-4.0-H); `partial_sums`: the
    feed-forwards leave their tensor-parallel partial sums to the layer,
    which reduces their sum once (Granite-4.0-H's experts and shared MLP);
    `whole`: the layer is `DecoderParts`' shape (one rotary attention, one
    feed-forward), which a backend may run its own way (`parts`).

    Modules are looked up by name on every call: a backend swaps them in
    place (backends/swap.py)."""

    def __init__(self, norm, norms: LayerNorms, mixers: dict[str, nn.Module], feed_forwards: dict[str, nn.Module],
                 *, scales: dict[str, tuple[float, float]] | None = None, residual: float = 1.0,
                 partial_sums: bool = False, whole: bool = False):
        super().__init__()
        for name, module in {**mixers, **feed_forwards}.items():
            setattr(self, name, module)
        self.mixers = tuple((name, isinstance(m, PagedSelfAttention), *(scales or {}).get(name, (1.0, 1.0)))
                            for name, m in mixers.items())
        self.feed_forwards = tuple(feed_forwards)
        self.norms = norms
        for name in (norms.input if mixers else None, norms.pre_mlp if feed_forwards else None,
                     norms.post_mixer, norms.post_mlp):
            if name is not None:
                setattr(self, name, norm())
        self.residual, self.whole = residual, whole
        self.ranks = current_ranks() if partial_sums else None

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else getattr(self, name)(x)

    def forward(self, x, cos_sin, batch):
        norms = self.norms
        if self.mixers:
            h = self._norm(norms.input, x)
            mixed = None
            for name, attends, scale_in, scale_out in self.mixers:
                mixer = getattr(self, name)
                hm = h if scale_in == 1.0 else h * scale_in
                y = mixer(hm, cos_sin, batch) if attends else mixer(hm, batch)
                if scale_out != 1.0:
                    y = y * scale_out
                mixed = y if mixed is None else mixed + y
            mixed = self._norm(norms.post_mixer, mixed)
            x = x + (mixed if self.residual == 1.0 else mixed * self.residual)
        if self.feed_forwards:
            h = self._norm(norms.pre_mlp, x)
            out = None
            for name in self.feed_forwards:
                y = getattr(self, name)(h)
                out = y if out is None else y + out
            if self.ranks is not None:
                out = self.ranks.all_reduce(out)
            out = self._norm(norms.post_mlp, out)
            x = x + (out if self.residual == 1.0 else out * self.residual)
        return x

    def parts(self) -> DecoderParts | None:
        """The layer as `DecoderParts` where it is of that shape (`whole`)."""
        if not self.whole:
            return None
        (name, *_), = self.mixers
        attention, (mlp,) = getattr(self, name), self.feed_forwards
        norms = [None if n is None else getattr(self, n)
                 for n in (self.norms.input, self.norms.pre_mlp, self.norms.post_mixer, self.norms.post_mlp)]
        return DecoderParts(attention, getattr(self, mlp), *norms, getattr(attention, "q_norm", None),
                            getattr(attention, "k_norm", None))


class DecoderStack(CausalLM):
    embedding = "embed_tokens"  # model.<embedding>: the token embeddings
    final_norm = "norm"  # model.<final_norm>
    eps = "rms_norm_eps"  # the config field of the norms' epsilon
    # the final norm's convention (layers/norm.py): Llama's `w * x`, in float32
    # before casting back where `scale_in_float32`, or Gemma's `(1 + w) * x` where `unit_offset`
    unit_offset = False
    scale_in_float32 = False
    norms = LayerNorms()  # the decoder layers' norms' names

    def __init__(self, config):
        super().__init__(config)
        hidden = config.hidden_size
        self.model = nn.Module()
        setattr(self.model, self.embedding, nn.Embedding(config.vocab_size, hidden))
        self.model.layers = nn.ModuleList(self.decoder_layers(config))
        setattr(self.model, self.final_norm, self.norm(hidden))
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
        """Layer `index` of the stack (a family's `layer`)."""
        raise NotImplementedError

    def norm(self, size: int | None = None) -> RMSNorm:
        """An RMS norm of the family's convention, over `size` (hidden) features."""
        return RMSNorm(size or self.config.hidden_size, getattr(self.config, self.eps), unit_offset=self.unit_offset,
                       scale_in_float32=self.scale_in_float32)

    def layer(self, mixers: dict[str, nn.Module], feed_forwards: dict[str, nn.Module], **options) -> DecoderLayer:
        """A decoder layer of these mixers and feed-forwards, with the family's norms."""
        return DecoderLayer(self.norm, self.norms, mixers, feed_forwards, **options)

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
        return self.lm_head(hidden)  # (the model's dtype: modeling/base.py)
