"""Dtype names: the one table of the dtypes hybridkv stores, their sizes and
the other spellings configs use for them. Torch-free, so the manager core
can size pages; `layers/dtypes.py` maps the same names to torch dtypes.

The names are torch's own (`torch.bfloat16` is "bfloat16"), so a spec's
dtype, a config's `torch_dtype` and a torch dtype's `str` all meet here."""

from __future__ import annotations

DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

# What a model's weights and activations may be in: the loader casts to one
# of these and the config reader takes the KV dtype from one of them.
MODEL_DTYPES = ("float32", "bfloat16", "float16")

# KV pages narrower than the model: each token's K row and V row of a head
# are stored as codes of one of these types and one float32 scale (value =
# code * scale), the row's largest magnitude mapped to the type's largest
# code (this table), so that no element saturates. Attention pages only:
# recurrent states are never quantized (a uniform int8 Gated DeltaNet
# state halved a model's GSM8K score; docs/kv_dtypes.md).
QUANTIZED_KV_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
KV_SCALE_DTYPE = "float32"
# What an attention layer's pages may hold, and a recurrent state.
KV_CACHE_DTYPES = (*MODEL_DTYPES, *QUANTIZED_KV_MAX)
RECURRENT_STATE_DTYPES = ("float32", "bfloat16")

# Other spellings of the same dtypes found in configs and on command lines
# (fp8 is e4m3, as in vLLM's `kv_cache_dtype`).
_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
            "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2"}


def dtype_name(raw) -> str | None:
    """The table's name for a dtype spelled `raw` ("bf16", "torch.bfloat16",
    a torch dtype itself), or None when the table does not know it."""
    name = str(raw).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in DTYPE_SIZES else None


def dtype_size(dtype: str) -> int:
    """Bytes per element of `dtype`, which must be a table name (a spec's
    dtype is compared for equality, so aliases are not taken here)."""
    try:
        return DTYPE_SIZES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}") from None
