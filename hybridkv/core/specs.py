"""Per-layer KV cache specs: what one layer must remember, in bytes.

A spec says nothing about where the memory lives; the layout planner
(`layout.py`) groups layers with equal specs and places them in the pool.
Specs are frozen and hashable so that "same spec" means "same group".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .dtypes import KV_CACHE_DTYPES, KV_SCALE_DTYPE, QUANTIZED_KV_MAX, dtype_name, dtype_size


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class AttentionSpec:
    """Common part of the attention specs: K and V rows of one layer."""

    recurrent = False
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        dtype_size(self.dtype)
        if self.quantized and self.head_size % 2:
            # the scales follow the codes in a layer's block: an even row keeps them 4-byte aligned
            raise ValueError(f"{type(self).__name__}: {self.dtype} pages need an even head_size, "
                             f"got {self.head_size}")

    @property
    def quantized(self) -> bool:
        """Codes and a scale per token and head (core/dtypes.py QUANTIZED_KV_MAX)."""
        return self.dtype in QUANTIZED_KV_MAX

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in this layer (quantized: their codes, and a
        float32 scale per head for each)."""
        row = self.head_size * dtype_size(self.dtype) + (dtype_size(KV_SCALE_DTYPE) if self.quantized else 0)
        return 2 * self.num_kv_heads * row

    def code_bytes(self, block_size: int) -> int:
        """Bytes of one block's K and V elements (a quantized layer's codes,
        which its scales follow: `[2, block_size, heads]` float32)."""
        return 2 * block_size * self.num_kv_heads * self.head_size * dtype_size(self.dtype)

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    # The read rule. A query at position i reads the keys first_visible(i) ..
    # i, a contiguous range for every attention type; this is the one place
    # that says where it starts. It takes ints, numpy arrays or torch
    # tensors alike (the managers, the runner's metadata and the kernels'
    # inputs all call it). `last_reader(j)`, its inverse, is the last query
    # position that still reads key j (NEVER: every later one does).
    @property
    def span(self) -> int | None:
        """Keys one query reads at most, itself included (None: unbounded)."""
        return None

    def first_visible(self, q):
        raise NotImplementedError

    def last_reader(self, j: int) -> int:
        raise NotImplementedError


NEVER = 1 << 62  # a position no request reaches


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Query i reads keys j <= i: the layer keeps every token."""

    kind = "full"

    def first_visible(self, q):
        return q * 0

    def last_reader(self, j: int) -> int:
        return NEVER


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Query i reads keys i - W < j <= i (W tokens including i, the
    Hugging Face convention): the layer keeps the last W - 1 tokens."""

    sliding_window: int = field(kw_only=True)
    kind = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("SlidingWindowSpec", sliding_window=self.sliding_window)

    @property
    def span(self) -> int:
        return self.sliding_window

    def first_visible(self, q):
        start = q - (self.sliding_window - 1)
        return start * (start > 0)  # max(0, start) for ints, numpy and torch alike

    def last_reader(self, j: int) -> int:
        return j + self.sliding_window - 1


@dataclass(frozen=True)
class ChunkedLocalSpec(AttentionSpec):
    """Query i reads keys j <= i in its own chunk (j // C == i // C)."""

    chunk_size: int = field(kw_only=True)
    kind = "chunked_local"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("ChunkedLocalSpec", chunk_size=self.chunk_size)

    @property
    def span(self) -> int:
        return self.chunk_size

    def first_visible(self, q):
        return q // self.chunk_size * self.chunk_size

    def last_reader(self, j: int) -> int:
        return (j // self.chunk_size + 1) * self.chunk_size - 1


# The recurrent mixers the engine knows, by the name their groups carry.
# The core treats them all alike (one state per request, the checkpoint
# rule); the kind keeps groups of different mixers apart and tells a
# backend which state update a group's layers run.
RECURRENT_KINDS = (
    "mamba",  # Mamba-1 (Jamba): conv window [I, K-1], SSM state [I, N]
    "mamba2",  # Mamba-2 / SSD (Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1): conv [I + 2GN, K-1], [H, P, N]
    "short_conv",  # gated short convolution (LFM2): conv window [D, K-1] only
    "gated_delta",  # Gated DeltaNet (Qwen3-Next): conv window over q, k, v and a per-head [k, v] matrix
)


@dataclass(frozen=True)
class RecurrentSpec:
    """A fixed-size recurrent state per request: `shapes[i]` has dtype
    `dtypes[i]` (e.g. a convolution window and an SSM state). `kind` names
    the mixer (one of RECURRENT_KINDS): layers of different kinds never
    share a group, whatever their shapes."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    kind: str = "mamba"
    recurrent = True

    def __post_init__(self) -> None:
        shapes = tuple(tuple(s) for s in self.shapes)
        dtypes = tuple(self.dtypes)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.kind not in RECURRENT_KINDS:
            raise ValueError(f"unknown recurrent kind {self.kind!r}; expected one of {', '.join(RECURRENT_KINDS)}")
        if not shapes or len(shapes) != len(dtypes):
            raise ValueError(f"a recurrent spec needs one dtype per state shape, got shapes={shapes} dtypes={dtypes}")
        for shape in shapes:
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(f"recurrent state shapes must be tuples of positive integers, got {shape!r}")
        for d in dtypes:
            dtype_size(d)

    @property
    def part_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def state_bytes(self) -> int:
        return sum(self.part_bytes)


# The name of the public API (docs/api.md): a Mamba state is the
# first recurrent kind; `MambaSpec(shapes, dtypes)` is a RecurrentSpec of kind "mamba".
MambaSpec = RecurrentSpec

LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalSpec | RecurrentSpec
SPEC_TYPES = {**{spec.kind: spec for spec in (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalSpec)},
              **dict.fromkeys(RECURRENT_KINDS, RecurrentSpec)}
ATTENTION_KINDS = ("full", "sliding_window", "chunked_local")

# How a `kv_cache_dtype` dict may name the attention kinds.
_KIND_NAMES = {"full": "full", "full_attention": "full", "sliding_window": "sliding_window",
               "sliding": "sliding_window", "chunked_local": "chunked_local", "chunked": "chunked_local"}


def kv_cache_dtypes(value) -> dict[str, str | None]:
    """Each attention kind's page dtype for an engine's `kv_cache_dtype`
    (None: the model's): None or "auto" for all, one dtype for every
    attention kind, or a dict by kind ({"full_attention": "int8",
    "sliding_window": "auto"}; a kind left out is "auto"). Dtypes by the
    table's names or their spellings ("fp8" is float8_e4m3fn); ValueError
    for anything else."""
    def one(raw, where: str) -> str | None:
        if raw is None or raw == "auto":
            return None
        name = dtype_name(raw)
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype{where}: {raw!r} is not a KV cache dtype; expected 'auto' or one of "
                             f"{', '.join(KV_CACHE_DTYPES)} (or fp8, fp8_e4m3, fp8_e5m2, bf16, fp16, fp32)")
        return name

    if isinstance(value, dict):
        unknown = [k for k in value if k not in _KIND_NAMES]
        if unknown:
            raise ValueError(f"kv_cache_dtype: unknown layer kind(s) {unknown}; expected some of "
                             f"{', '.join(_KIND_NAMES)}")
        out = dict.fromkeys(ATTENTION_KINDS)
        for key, raw in value.items():
            out[_KIND_NAMES[key]] = one(raw, f"[{key!r}]")
        return out
    if value is not None and not isinstance(value, str):
        raise ValueError(f"kv_cache_dtype must be 'auto', a dtype name or a dict by layer kind, got {value!r}")
    return dict.fromkeys(ATTENTION_KINDS, one(value, ""))


def with_kv_cache_dtype(specs: dict[str, LayerSpec], kv_cache_dtype) -> dict[str, LayerSpec]:
    """`specs` with each attention layer's pages in its kind's dtype
    (`kv_cache_dtypes`); recurrent states and "auto" kinds unchanged."""
    by_kind = kv_cache_dtypes(kv_cache_dtype)
    out = {}
    for name, spec in specs.items():
        dtype = None if spec.recurrent else by_kind[spec.kind]
        out[name] = spec if dtype is None or dtype == spec.dtype else replace(spec, dtype=dtype)
    return out
