"""Which models tensor parallelism splits, and the sizes it must divide.

The split itself is in the layers (layers/parallel.py: column- and
row-parallel linear layers, the vocabulary-parallel LM head) that the
family files build where it applies; this checks a model before its ranks
are built, and gives the config as one rank sees it, from which the KV
cache's per-rank specs are read (its KV heads, its Mamba channels)."""

from __future__ import annotations

import copy

SPLIT_FAMILIES = ("gemma3_text", "gemma2", "gemma3", "llama", "mistral", "jamba")


def rank_config(text, world: int):
    """The model config as one rank sees it: its share of the query heads,
    KV heads and MLP width (and Mamba channels). Raises ValueError, naming
    the size that does not divide, or the layers that cannot be split yet."""
    if world == 1:
        return text
    model_type = getattr(text, "model_type", "")
    if model_type == "gpt_oss":
        raise ValueError("tensor parallelism does not split gpt-oss yet: its attention sinks (one per query head) "
                         "and its stacked experts would need their own cuts; run it in one process")
    if model_type not in SPLIT_FAMILIES:
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
    out.num_key_value_heads = max(1, kv_heads // world)  # as the attention layers hold them
    out.intermediate_size = text.intermediate_size // world
    if model_type == "jamba":
        out.mamba_inner = text.mamba_expand * text.hidden_size // world
    return out
