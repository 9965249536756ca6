"""Rotary position embeddings (rotate-half convention), with the inverse
frequencies of any rope type transformers knows."""

from __future__ import annotations

import torch


def inverse_frequencies(config, layer_type: str | None = None, head_dim: int | None = None):
    """(inv_freq, attention_scaling) for `layer_type`'s rope parameters."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        # On the CPU even while the model is built on the meta device (the
        # loader's), where their tensors would have no values.
        with torch.device("cpu"):
            if layer_type is not None and layer_type in (config.rope_parameters or {}):
                return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
            return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Only the first part of each head may rotate (Bamba: half of it).
    dim = int(dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
    return inv_freq, 1.0


class Rotary:
    """cos/sin for token positions, cached per step by the caller."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0):
        self.inv_freq = inv_freq.float()
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.inv_freq.device != positions.device:  # moved once, not every step (nor inside a captured one)
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos, sin: [tokens, rotary dim]. With a
    rotary dim below head_dim only the first channels of each head rotate."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
