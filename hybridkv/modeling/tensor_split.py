"""How a model is split for tensor parallelism (engine/tensor_parallel.py
runs the ranks): each rank's share of the config, which slice of each
checkpoint tensor it reads, and the all-reduce its split products end with.
Here, below the engine, because the loader builds each rank's part."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist


def rank_config(text, world: int):
    """The model config as one rank sees it: its share of the query heads,
    KV heads and MLP width. Raises ValueError, naming the size that does not
    divide, or the layers that cannot be split yet."""
    if world == 1:
        return text
    model_type = getattr(text, "model_type", "")
    if model_type == "gpt_oss":
        raise ValueError("tensor parallelism does not split gpt-oss yet: its attention sinks (one per query head) "
                         "and its stacked experts would need their own cuts; run it in one process")
    if model_type not in ("gemma3_text", "gemma2", "gemma3", "llama", "mistral", "jamba"):
        raise ValueError(f"tensor parallelism splits Gemma-3, Gemma-2, Llama, Mistral and Jamba; "
                         f"{model_type or '?'} has layers it does not split yet")
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    sizes = [("num_attention_heads", heads), ("intermediate_size", text.intermediate_size)]
    if model_type == "jamba":
        sizes.append(("Mamba channels (mamba_expand x hidden_size)", text.mamba_expand * text.hidden_size))
    for what, n in sizes:
        if n % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide {what}={n}")
    if kv_heads >= world and kv_heads % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide num_key_value_heads={kv_heads}")
    if kv_heads < world and world % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} does not divide tensor_parallel_size={world}")
    out = copy.deepcopy(text)
    out.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads  # before heads change
    out.num_attention_heads = heads // world
    out.num_key_value_heads = max(1, kv_heads // world)
    out.intermediate_size = text.intermediate_size // world
    if model_type == "jamba":
        out.mamba_inner = text.mamba_expand * text.hidden_size // world
    return out


def vocab_part(vocab: int, world: int) -> int:
    """Rows of the LM head per rank (the last rank may hold fewer: its
    logits are padded to this width for the gather)."""
    return -(-vocab // world)


class Shard:
    """Which slice of each checkpoint tensor rank `rank` of `world` holds
    (modeling/loader.py reads just those bytes)."""

    def __init__(self, rank: int, world: int, full_config):
        self.rank, self.world = rank, world
        heads, kv_heads = full_config.num_attention_heads, full_config.num_key_value_heads
        self.head_dim = getattr(full_config, "head_dim", None) or full_config.hidden_size // heads
        self.q_rows = self._range(heads // world * self.head_dim)
        if kv_heads >= world:
            self.kv_rows = self._range(kv_heads // world * self.head_dim)
        else:  # the one KV head this rank's query heads read
            kv = rank * heads // world // (heads // kv_heads)
            self.kv_rows = slice(kv * self.head_dim, (kv + 1) * self.head_dim)
        self.mlp_rows = self._range(full_config.intermediate_size // world)
        part = vocab_part(full_config.vocab_size, world)
        self.vocab_rows = slice(rank * part, min(full_config.vocab_size, (rank + 1) * part))
        self.vocab_size = self.vocab_rows.stop - self.vocab_rows.start
        self.tied = bool(getattr(full_config, "tie_word_embeddings", False))
        inner = getattr(full_config, "mamba_expand", 0) * full_config.hidden_size
        self.channels = self._range(inner // world)  # a Mamba layer's channels here
        # in_proj's rows are x's channels, then the gate's: this rank's of each.
        self.in_proj_rows = [self.channels, slice(inner + self.channels.start, inner + self.channels.stop)]

    def _range(self, size: int) -> slice:
        return slice(self.rank * size, (self.rank + 1) * size)

    def slices(self, name: str, ndim: int):
        """The index of parameter `name`'s slice here, or None: whole. Its
        first entry may be a list of row slices, read one after the other."""
        leaf = name.rsplit(".", 2)
        module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", leaf[-1])
        if kind in ("A_log", "D"):  # a Mamba layer's per-channel parameters
            return (self.channels,) if ndim == 1 else (self.channels, slice(None))
        rows = {"q_proj": self.q_rows, "k_proj": self.kv_rows, "v_proj": self.kv_rows,
                "gate_proj": self.mlp_rows, "up_proj": self.mlp_rows, "lm_head": self.vocab_rows,
                "in_proj": self.in_proj_rows, "conv1d": self.channels, "dt_proj": self.channels}.get(module)
        if rows is not None and ndim == 3:  # conv1d's weight [channels, 1, width]
            return (rows, slice(None), slice(None))
        if rows is not None:
            return (rows,) if kind == "bias" or ndim == 1 else (rows, slice(None))
        columns = {"o_proj": self.q_rows, "down_proj": self.mlp_rows, "x_proj": self.channels,
                   "out_proj": self.channels}.get(module)
        if columns is not None and kind == "weight":
            return (slice(None), columns)
        return None

    def bias_here(self, name: str) -> bool:
        """A row-parallel output's bias is added once: on rank 0."""
        return not (name.endswith(("o_proj.bias", "down_proj.bias", "out_proj.bias")) and self.rank)

    def finish(self, model) -> None:
        """After loading: a tied LM head is this rank's rows of the embedding
        (a view, no copy); outputs of split products are all-reduced."""
        if self.tied:
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight[self.vocab_rows],
                                                      requires_grad=False)
        for module in model.modules():
            if hasattr(module, "reduce"):
                module.reduce = all_reduce
        for module in model.modules():  # a mixture of experts sums its experts' partial outputs once
            for expert in getattr(module, "experts", ()):
                expert.reduce = None


# What this process's all-reduces moved (benchmarks/tensor_parallel.py reads them).
REDUCED = {"calls": 0, "bytes": 0}


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    REDUCED["calls"] += 1
    REDUCED["bytes"] += x.numel() * x.element_size()
    return x
