"""What every model family provides to the engine."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.step import StepBatch


class CacheLayer:
    """A module that keeps per-request cache state (an attention or a Mamba
    layer). The worker binds it to its KV cache group and its place in the
    pool: `group`, and for attention `column` (which page of a block holds
    this layer), `columns` and `piece_heads` (the page and KV heads of each
    piece, where the layout cuts the layer's blocks by heads: `column`
    first; heads 0, every head, where it does not); the step's `buffers`
    give its view of the pool by `layer_name`. The backend binds `ops`, the side of it (attention or
    recurrent, layers/backends/base.py) whose ops the layer calls."""

    layer_name: str = ""
    group: int = -1
    column: int = 0
    columns: tuple[int, ...] = (0,)
    piece_heads: tuple[int, ...] = (0,)
    ops = None


class CausalLM(nn.Module):
    """A decoder-only LM over one flat batch of tokens from many requests."""

    # Name prefixes (after the loader's renames) of the checkpoint tensors
    # the family's released checkpoints carry beside the language model
    # (a vision tower, MTP layers): read past; any other tensor the model
    # has no parameter for is refused (loader.py).
    unused_weights: tuple[str, ...] = ()

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the final norm."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] for the given hidden rows: float32, or the
        LM head's own bfloat16 where nothing after it needs float32 (the
        sampler's greedy pick reads them as they are; whatever computes
        with them, a softmax or a temperature, widens the rows it takes:
        at a 262,144-word vocabulary, widening a batch-64 step's logits
        writes 67 MB that the pick would then read back)."""
        raise NotImplementedError

    def cache_layers(self) -> dict[str, CacheLayer]:
        """Layer name (as in the KV specs: model.layers.{i}) -> its cache module."""
        out = {}
        for name, module in self.named_modules():
            if isinstance(module, CacheLayer):
                out[name.rsplit(".", 1)[0]] = module
        return out

    def tie_weights(self) -> None:
        """Share the output projection with the embedding when the config says so."""
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.tie(self.model.embed_tokens)

    def fuse_projections(self) -> None:
        """After loading: modules that can run several projections as one
        matmul (q/k/v, gate/up) fuse them, without copying the weights."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse"):
                module.fuse()

    def weight_name(self, checkpoint_name: str) -> str | None:
        """Map a checkpoint tensor name to a parameter name (None: skip it)."""
        return checkpoint_name
