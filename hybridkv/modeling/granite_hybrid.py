"""Granite-4.0-H (`granitemoehybrid`): Mamba-2 layers (mamba2.py, Bamba's
mixer) and attention layers, each followed by a mixture of experts beside a
shared SiLU-gated MLP (or the shared MLP alone when `num_local_experts` is
0: the dense -Micro and 1B models). muP-style scalars: embeddings times
`embedding_multiplier`, attention scale `attention_multiplier`, both
residual branches times `residual_multiplier`, logits divided by
`logits_scaling`. RoPE only where `position_embedding_type` is "rope" (the
released Granite-4.0-H models use none). The router is a softmax over the
top-k logits; the experts are stored as 3D tensors
(`input_linear [E, 2I, H]`: gate then up; `output_linear [E, H, I]`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.parallel import ColumnParallelLinear, current_ranks
from .experts import Router, Routing, mix_experts
from .mamba2 import mamba2_mixer
from .stack import DecoderStack
from .sublayers import GatedMLP, PagedSelfAttention


class SharedMLP(GatedMLP):
    """The shared expert: gate and up stored as one weight (`input_linear`,
    gate first), `output_linear` down. Under tensor parallelism a rank holds
    its share of the gate rows and of the up rows; down's partial sums are
    left to the layer, which reduces them once with the experts'."""

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__(hidden, intermediate, activation, reduce=False)
        del self.gate_proj, self.up_proj
        share = current_ranks().share(intermediate)
        up = slice(intermediate + share.start, intermediate + share.stop)
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * intermediate, bias=False, rows=[share, up])

    def fuse(self) -> None:
        pass  # stored fused


class GraniteMoE(nn.Module):
    """The experts stacked; under tensor parallelism each split by its
    width (its share of the gate rows and of the up rows of
    `input_linear`, the matching columns of `output_linear`), the router
    whole; partial sums, reduced by the layer."""

    def __init__(self, config):
        super().__init__()
        self.ranks = ranks = current_ranks()
        experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.router = Router(hidden, experts, Routing(config.num_experts_per_tok, top_k_first=True))
        local = inner // ranks.world
        self.share = ranks.share(inner)
        self.gate_up_rows = [self.share, slice(inner + self.share.start, inner + self.share.stop)]
        self.input_linear = nn.Parameter(torch.zeros(experts, 2 * local, hidden))
        self.output_linear = nn.Parameter(torch.zeros(experts, hidden, local))
        self.act = F.silu if config.hidden_act in ("silu", "swish") else None
        if self.act is None:
            raise ValueError(f"Granite-4.0-H experts with activation {config.hidden_act!r} are not supported")

    def checkpoint_part(self, name: str, ndim: int):
        if self.ranks.world == 1 or name not in ("input_linear", "output_linear"):
            return None
        if name == "input_linear":
            return (slice(None), self.gate_up_rows)
        return (slice(None), slice(None), self.share)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.output_linear[e])

    def forward(self, x):
        weights, chosen = self.router(x)
        return mix_experts(x, weights, chosen, self.expert, self.input_linear.shape[0])


class GraniteMoeHybridForCausalLM(DecoderStack):
    def decoder_layer(self, config, index: int) -> nn.Module:
        if config.layer_types[index] in ("full_attention", "attention"):
            mixer = {"self_attn": PagedSelfAttention(config, scale=config.attention_multiplier)}
        else:
            mixer = {"mamba": mamba2_mixer(config)}
        shared = SharedMLP(config.hidden_size, config.shared_intermediate_size, config.hidden_act)
        feed_forwards = {"shared_mlp": shared, **({"block_sparse_moe": GraniteMoE(config)}
                                                 if config.num_local_experts > 0 else {})}
        # (both leave partial sums: the layer reduces their sum once)
        return self.layer(mixer, feed_forwards, residual=config.residual_multiplier, partial_sums=True)

    def has_rotary(self, config) -> bool:
        return config.position_embedding_type == "rope"

    def weight_name(self, checkpoint_name: str) -> str | None:
        return (checkpoint_name.replace(".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj.")
                .replace(".shared_mlp.output_linear.", ".shared_mlp.down_proj.")
                .replace(".block_sparse_moe.router.layer.", ".block_sparse_moe.router.")
                .replace(".block_sparse_moe.input_linear.weight", ".block_sparse_moe.input_linear")
                .replace(".block_sparse_moe.output_linear.weight", ".block_sparse_moe.output_linear"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.lm_head(hidden) / self.config.logits_scaling).float()
