"""Per-layer specs from a Hugging Face `config.json` dict, without torch or
transformers. The defaults for missing fields follow transformers 5.x's
config classes for each family (checked against their source)."""

from __future__ import annotations

import json
import os

from .dtypes import MODEL_DTYPES, dtype_name
from .specs import ChunkedLocalSpec, FullAttentionSpec, LayerSpec, RecurrentSpec, SlidingWindowSpec

# The one list of supported models. Every config.json `model_type` this
# reader plans a KV cache for, with the config.json `architectures` of it
# that the engine runs (none: no model code, `hybridkv plan` only). The
# loader, the GGUF converter and both error messages read it from here,
# torch-free, so that the list cannot differ between them.
MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "gemma3_text": ("Gemma3ForCausalLM",),
    "gemma3": ("Gemma3ForConditionalGeneration",),  # the engine runs its language model
    "gemma2": ("Gemma2ForCausalLM",),
    "jamba": ("JambaForCausalLM",),
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "ministral": ("MinistralForCausalLM",),
    "gpt_oss": ("GptOssForCausalLM",),
    "mixtral": (), "llama4": (), "llama4_text": (), "cohere2": (), "qwen2": (), "qwen3": (),
    "qwen3_moe": (), "bamba": ("BambaForCausalLM",), "granitemoehybrid": ("GraniteMoeHybridForCausalLM",),
    "nemotron_h": ("NemotronHForCausalLM",), "qwen3_next": ("Qwen3NextForCausalLM",),
    "falcon_h1": ("FalconH1ForCausalLM",), "lfm2": ("Lfm2ForCausalLM",),
    # Qwen3.5: the language model alone, or (the released checkpoints) inside the multimodal model
    "qwen3_5_text": ("Qwen3_5ForCausalLM",), "qwen3_5": ("Qwen3_5ForConditionalGeneration",),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM",), "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration",),
}
# The model types whose recurrent layers are Gated DeltaNet (their configs name them `linear_*`).
GATED_DELTA_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
# config.json architecture -> model_type, for the architectures the engine runs.
ENGINE_ARCHITECTURES = {arch: model_type for model_type, archs in MODEL_TYPES.items() for arch in archs}


def load_config(path: str) -> dict:
    """A config.json file, or a model folder holding one."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no config.json at {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def text_config(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config."""
    inner = config.get("text_config")
    if isinstance(inner, dict) and "num_hidden_layers" in inner:
        merged = dict(inner)
        merged.setdefault("torch_dtype", config.get("torch_dtype") or config.get("dtype"))
        return merged
    return config


def _need(cfg: dict, key: str, family: str):
    if cfg.get(key) is None:
        raise ValueError(f"{family} config is missing {key!r}")
    return cfg[key]


def _dtype(cfg: dict, override: str | None) -> str:
    raw = override or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    name = dtype_name(raw)
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {raw!r} in config")
    return name


def _attention_dims(cfg: dict, family: str) -> tuple[int, int]:
    heads = _need(cfg, "num_attention_heads", family)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or _need(cfg, "hidden_size", family) // heads
    return kv_heads, head_dim


def _mamba1_spec(cfg: dict, dtype: str, state_dtype: str) -> RecurrentSpec:
    # mamba_inner: a tensor-parallel rank's share of the channels (modeling/tensor_split.py).
    d_inner = cfg.get("mamba_inner") or cfg.get("mamba_expand", 2) * _need(cfg, "hidden_size", "Jamba")
    d_conv, d_state = cfg.get("mamba_d_conv", 4), cfg.get("mamba_d_state", 16)
    # The conv state keeps the d_conv - 1 inputs before the current one.
    return RecurrentSpec(shapes=((d_inner, d_conv - 1), (d_inner, d_state)), dtypes=(dtype, state_dtype),
                         kind="mamba")


def _mamba2_spec(cfg: dict, family: str, dtype: str, state_dtype: str, names: dict) -> RecurrentSpec:
    get = lambda key, default=None: cfg.get(names.get(key, key), default)  # noqa: E731
    n_heads = get("n_heads")
    if n_heads is None:
        raise ValueError(f"{family} config is missing {names.get('n_heads', 'n_heads')!r}")
    expand, hidden = get("expand", 2), _need(cfg, "hidden_size", family)
    d_head = get("d_head")
    if d_head in (None, "auto"):
        # Falcon-H1 may name the channels outright (mamba_d_ssm); else expand x hidden.
        d_head = (cfg.get("mamba_d_ssm") or expand * hidden) // n_heads
    n_groups, d_state, d_conv = get("n_groups", 1), get("d_state", 128), get("d_conv", 4)
    # The conv window runs over x, B and C; the SSM state is [heads, head_dim, state].
    conv_dim = n_heads * d_head + 2 * n_groups * d_state
    return RecurrentSpec(shapes=((conv_dim, d_conv - 1), (n_heads, d_head, d_state)), dtypes=(dtype, state_dtype),
                         kind="mamba2")


MAMBA2_NAMES = {
    "bamba": {"n_heads": "mamba_n_heads", "d_head": "mamba_d_head", "n_groups": "mamba_n_groups",
              "d_state": "mamba_d_state", "d_conv": "mamba_d_conv", "expand": "mamba_expand"},
    "granitemoehybrid": {"n_heads": "mamba_n_heads", "d_head": "mamba_d_head", "n_groups": "mamba_n_groups",
                         "d_state": "mamba_d_state", "d_conv": "mamba_d_conv", "expand": "mamba_expand"},
    "nemotron_h": {"n_heads": "mamba_num_heads", "d_head": "mamba_head_dim", "n_groups": "n_groups",
                   "d_state": "ssm_state_size", "d_conv": "conv_kernel", "expand": "expand"},
}
MAMBA2_NAMES["falcon_h1"] = MAMBA2_NAMES["bamba"]


def _layer_kinds(cfg: dict, model_type: str) -> list[str]:
    """One of 'full', 'sliding', 'chunked', 'recurrent', 'none' per layer, or
    'parallel' (attention and a recurrent mixer side by side: Falcon-H1)."""
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    # (transformers 5 saves Nemotron-H without num_hidden_layers: its block list says it)
    n = len(types) if types and cfg.get("num_hidden_layers") is None else _need(cfg, "num_hidden_layers", model_type)
    if model_type == "nemotron_h":
        pattern = cfg.get("hybrid_override_pattern")
        if pattern:
            table = {"M": "recurrent", "*": "full", "-": "none", "E": "none"}
            return [table[c] for c in pattern]
    if model_type == "jamba":
        period, offset = cfg.get("attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        return ["full" if i % period == offset else "recurrent" for i in range(n)]
    if model_type == "falcon_h1":
        return ["parallel"] * n
    if model_type == "lfm2" and not types:  # (LFM2's first configs name the attention layers by index)
        indices = cfg.get("full_attn_idxs")
        return ["full" if indices is None or i in indices else "recurrent" for i in range(n)]
    if model_type == "bamba" and not types:
        indices = set(cfg.get("attn_layer_indices") or ())
        return ["full" if i in indices else "recurrent" for i in range(n)]
    if types:
        table = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
                 "chunked_attention": "chunked", "linear_attention": "recurrent", "mamba": "recurrent",
                 "conv": "recurrent", "mlp": "none", "moe": "none"}
        try:
            return [table[t] for t in types]
        except KeyError as e:
            raise ValueError(f"{model_type}: unknown layer type {e.args[0]!r} in layer_types") from None
    if model_type in ("gemma3", "gemma3_text"):
        pattern = cfg.get("sliding_window_pattern", 6)
        return ["sliding" if (i + 1) % pattern else "full" for i in range(n)]
    if model_type in ("gemma2", "gpt_oss"):
        return ["sliding" if (i + 1) % 2 else "full" for i in range(n)]
    if model_type in ("llama4", "llama4_text"):
        interval = cfg.get("no_rope_layer_interval", 4)
        no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
        # transformers: a layer with RoPE (no_rope_layers[i] == 1) uses chunked attention.
        chunked = cfg.get("attention_chunk_size") is not None
        return ["chunked" if (flag and chunked) else "full" for flag in no_rope]
    if model_type in ("mistral", "ministral", "mixtral", "qwen2", "cohere2"):
        window = cfg.get("sliding_window")
        use = cfg.get("use_sliding_window", True)
        return ["sliding" if window and use else "full" for _ in range(n)]
    if model_type in GATED_DELTA_TYPES:
        interval = cfg.get("full_attention_interval", 4)
        return ["full" if (i + 1) % interval == 0 else "recurrent" for i in range(n)]
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        return ["full"] * n
    raise ValueError(f"{model_type}: cannot tell the layer types")


def specs_from_config(config: dict, dtype: str | None = None, state_dtype: str = "float32",
                      prefix: str = "model.layers") -> dict[str, LayerSpec]:
    """Per-layer KV cache specs, named `{prefix}.{i}`; layers without a cache
    (Nemotron-H's MLP blocks) are left out. A parallel layer (Falcon-H1) has
    two: its attention at `{prefix}.{i}` and its Mamba state at
    `{prefix}.{i}.mamba`."""
    cfg = text_config(config)
    model_type = cfg.get("model_type") or config.get("model_type")
    if model_type not in MODEL_TYPES:
        known = ", ".join(sorted(MODEL_TYPES))
        raise ValueError(f"unsupported architecture: model_type {model_type!r} "
                         f"(architectures={config.get('architectures')}); supported model types: {known}")
    kv_dtype = _dtype(cfg, dtype)
    kinds = _layer_kinds(cfg, model_type)
    specs: dict[str, LayerSpec] = {}
    attn = None
    for i, kind in enumerate(kinds):
        if kind == "none":
            continue
        if kind in ("full", "sliding", "chunked", "parallel") and attn is None:
            attn = _attention_dims(cfg, model_type)
        if kind == "parallel":
            specs[f"{prefix}.{i}"] = FullAttentionSpec(num_kv_heads=attn[0], head_size=attn[1], dtype=kv_dtype)
            specs[f"{prefix}.{i}.mamba"] = _recurrent_spec(cfg, model_type, kv_dtype, state_dtype)
            continue
        if kind == "full":
            spec = FullAttentionSpec(num_kv_heads=attn[0], head_size=attn[1], dtype=kv_dtype)
        elif kind == "sliding":
            spec = SlidingWindowSpec(num_kv_heads=attn[0], head_size=attn[1], dtype=kv_dtype,
                                     sliding_window=_need(cfg, "sliding_window", model_type))
        elif kind == "chunked":
            spec = ChunkedLocalSpec(num_kv_heads=attn[0], head_size=attn[1], dtype=kv_dtype,
                                    chunk_size=_need(cfg, "attention_chunk_size", model_type))
        else:
            spec = _recurrent_spec(cfg, model_type, kv_dtype, state_dtype)
        specs[f"{prefix}.{i}"] = spec
    if not specs:
        raise ValueError(f"{model_type}: no layer with a KV cache or state")
    return specs


def _recurrent_spec(cfg: dict, model_type: str, dtype: str, state_dtype: str) -> RecurrentSpec:
    if model_type == "jamba":
        return _mamba1_spec(cfg, dtype, state_dtype)
    if model_type in MAMBA2_NAMES:
        return _mamba2_spec(cfg, model_type, dtype, state_dtype, MAMBA2_NAMES[model_type])
    if model_type in GATED_DELTA_TYPES:
        # Gated DeltaNet: a causal conv over q, k, v and a per-head k x v state.
        k_heads = _need(cfg, "linear_num_key_heads", model_type)
        v_heads = _need(cfg, "linear_num_value_heads", model_type)
        k_dim = _need(cfg, "linear_key_head_dim", model_type)
        v_dim = _need(cfg, "linear_value_head_dim", model_type)
        conv = cfg.get("linear_conv_kernel_dim", 4)
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        return RecurrentSpec(shapes=((conv_dim, conv - 1), (v_heads, k_dim, v_dim)), dtypes=(dtype, state_dtype),
                             kind="gated_delta")
    if model_type == "lfm2":
        # The gated short convolution keeps only its window: the L_cache - 1
        # inputs (B * x, hidden wide) before the next token.
        # (short_conv_channels: a tensor-parallel rank's share of them, modeling/tensor_split.py)
        width = cfg.get("conv_L_cache", 3)
        channels = cfg.get("short_conv_channels") or _need(cfg, "hidden_size", model_type)
        return RecurrentSpec(shapes=((channels, width - 1),), dtypes=(dtype,),
                             kind="short_conv")
    raise ValueError(f"{model_type}: recurrent layers are not supported")
