"""What a pre-norm decoder layer is made of, as data: the attention, the
gated MLP and the RMS norms around them. A family's decoder layer says it
(`parts()`); a backend that runs whole layers its own way reads it (the
cpu backend's one-call decode layer) and needs nothing else of the
family."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecoderParts:
    """x += post_attention_norm(attention(input_norm(x)));
    x += post_feedforward_norm(mlp(pre_feedforward_norm(x))), with q_norm
    and k_norm on the heads before the rotary embedding. A norm the family
    lacks is None (the identity)."""

    attention: object  # modeling/sublayers.PagedSelfAttention
    mlp: object  # layers/mlp.GatedMLP
    input_norm: object
    pre_feedforward_norm: object
    post_attention_norm: object = None
    post_feedforward_norm: object = None
    q_norm: object = None
    k_norm: object = None

    def norms(self) -> list:
        return [n for n in (self.input_norm, self.pre_feedforward_norm, self.post_attention_norm,
                            self.post_feedforward_norm, self.q_norm, self.k_norm) if n is not None]
