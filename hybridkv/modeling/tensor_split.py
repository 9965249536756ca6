"""The sizes tensor parallelism divides, for every family, and the config
as one rank sees it.

The split itself is in the layers (layers/parallel.py: column- and
row-parallel linear layers, the vocabulary-parallel LM head) that the
family files build; this checks a model before its ranks are built (one
place for every size that must divide), and gives the config as one rank
sees it, from which the KV cache's per-rank specs are read (its KV heads,
its recurrent layers' heads, groups and channels)."""

from __future__ import annotations

import copy

from ..core.hf_config import GATED_DELTA_TYPES, MAMBA2_NAMES

# Per family, the feed-forward widths its layers split (config attribute
# names; those a config lacks or sets to 0 are not used by its layers).
MLP_WIDTHS = {
    "nemotron_h": ("intermediate_size", "moe_intermediate_size", "moe_shared_expert_intermediate_size"),
    "granitemoehybrid": ("shared_intermediate_size", "intermediate_size"),
    "qwen3_next": ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"),
    "qwen3_5_moe_text": ("moe_intermediate_size", "shared_expert_intermediate_size"),
}


def mamba2_sizes(text) -> tuple[int, int, int]:
    """(heads, head_dim, groups) of a Mamba-2 family's mixers, read as the
    family's config names them (core/hf_config.py MAMBA2_NAMES)."""
    names = MAMBA2_NAMES[text.model_type]
    heads = getattr(text, names["n_heads"])
    head_dim = getattr(text, names["d_head"], None)
    if not isinstance(head_dim, int):  # "auto": the channels (Falcon-H1 may name them) over the heads
        inner = getattr(text, "mamba_d_ssm", None) or getattr(text, names["expand"], 2) * text.hidden_size
        head_dim = inner // heads
    return heads, head_dim, getattr(text, names["n_groups"], 1)


def _divides(world: int, what: str, n: int) -> None:
    if n % world:
        raise ValueError(f"tensor_parallel_size={world} does not divide {what}={n}")


def rank_config(text, world: int):
    """The model config as one rank sees it: its share of the attention
    heads, the MLP width, the recurrent layers' heads or channels. Raises
    ValueError naming the first size that does not divide."""
    if world == 1:
        return text
    model_type = getattr(text, "model_type", "")
    out = copy.deepcopy(text)
    heads = getattr(text, "num_attention_heads", None)
    if heads:  # every family here has attention layers
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        _divides(world, "num_attention_heads", heads)
        if kv_heads >= world and kv_heads % world:
            raise ValueError(f"tensor_parallel_size={world} does not divide num_key_value_heads={kv_heads}")
        if kv_heads < world and world % kv_heads:
            raise ValueError(f"num_key_value_heads={kv_heads} does not divide tensor_parallel_size={world}")
        out.head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads  # before heads change
        out.num_attention_heads = heads // world
        out.num_key_value_heads = max(1, kv_heads // world)  # as the attention layers hold them
    if model_type == "lfm2":
        from .lfm2 import mlp_width

        widths = [("the MLP width (block_ff_dim as adjusted)", mlp_width(text))]
    else:
        widths = [(name, getattr(text, name, 0) or 0) for name in MLP_WIDTHS.get(model_type, ("intermediate_size",))]
    for name, width in widths:
        _divides(world, name, width)
    if getattr(text, "intermediate_size", None):
        out.intermediate_size = text.intermediate_size // world
    if model_type == "jamba":
        inner = text.mamba_expand * text.hidden_size
        _divides(world, "Mamba channels (mamba_expand x hidden_size)", inner)
        out.mamba_inner = inner // world  # (core/hf_config.py reads the rank's channels there)
    elif model_type in MAMBA2_NAMES:
        m_heads, head_dim, groups = mamba2_sizes(text)
        names = MAMBA2_NAMES[model_type]
        _divides(world, names["n_heads"], m_heads)
        if groups % world and world % groups:
            raise ValueError(f"tensor_parallel_size={world} and {names['n_groups']}={groups}: one must divide the "
                             f"other (a rank holds whole groups, or its heads read one group)")
        setattr(out, names["n_heads"], m_heads // world)
        setattr(out, names["d_head"], head_dim)
        setattr(out, names["n_groups"], max(1, groups // world))
    elif model_type in GATED_DELTA_TYPES:
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            _divides(world, name, getattr(text, name))
            setattr(out, name, getattr(text, name) // world)
    elif model_type == "lfm2":
        _divides(world, "hidden_size (the short convolutions' channels)", text.hidden_size)
        out.short_conv_channels = text.hidden_size // world  # (core/hf_config.py reads the rank's channels there)
    return out
