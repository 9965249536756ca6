"""EngineConfig: every option of an engine, validated in one place.

    config = EngineConfig("path/to/model", kv_cache_memory="2GiB", tensor_parallel_size=2)
    engine = Engine(config)          # or Engine("path/to/model", kv_cache_memory=..., ...)

`Engine(model, **options)`, `hybridkv serve` and the Ray replicas all build
one; a bad value is a `ValueError` saying which option and why, raised here
before anything is loaded. What they ask of the machine (the device, the
memory) is checked apart, where the engine runs: `check_machine()`. The
config is frozen: `replace(**changes)` gives a new, validated one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass

import torch

from ..core.checkpoints import get_policy
from ..core.dtypes import MODEL_DTYPES, RECURRENT_STATE_DTYPES, dtype_name
from ..core.layout import parse_memory
from ..core.specs import kv_cache_dtypes
from ..layers.backends import CHOICES as BACKENDS, check as check_backend

SPECULATIVE_METHODS = (None, "ngram")


@dataclass(frozen=True)
class EngineConfig:
    """`backend`: "auto" (default, or $HYBRIDKV_BACKEND), "torch", "cpu",
    "triton", "flashinfer" or "triton+flashinfer" (layers/backends/), chosen
    once; how it prepared the model and how many steps ran each route is in
    the engine's `stats["backend"]`. `enforce_eager`: no CUDA graphs.
    `fixed_shape_decode`: run decode steps at bucketed fixed shapes (None:
    where CUDA graphs capture them).
    `speculative_method="ngram"`: each decoding step also verifies up to
    `num_speculative_tokens` draft tokens found by prompt lookup (the last
    prompt_lookup_max..prompt_lookup_min tokens matched earlier in the
    sequence; speculative.py): greedy outputs are unchanged, sampled ones
    keep their distribution (a seeded request's draws then depend on how
    many drafts each step verified, which the batch can change).
    Tiers below the pool (tiers/): `kv_host_cache_memory` ("4GiB")
    keeps the blocks the pool evicts in host memory; `kv_disk_cache` (a
    directory) keeps what host memory evicts, or with no host tier what the
    pool evicts, in files, up to `kv_disk_cache_memory` bytes, and survives
    a restart (the engine's `close()` writes what the pool still caches
    there too). Both need prefix caching. Under tensor parallelism every
    rank has its own tiers (its slices of the blocks, its own files), with
    these budgets each.
    `kv_role`: prefill and decode on different engines over one
    `kv_disk_cache` directory both read (on one machine, /dev/shm is
    shared memory). "prefill": once a prompt is computed, the blocks a hit
    of it reads (KVCacheManager.blocks_for_hit: every full-attention
    block, the windows' last blocks, the recurrent state at its last whole
    block) go to that directory at once. "decode": a new request's blocks
    that the directory holds (by name) join the tiers' index, and its hit
    loads them. None: neither.
    `enable_kv_events`: the manager records what its cache can serve as it
    changes (core/events.py); the engine's `take_kv_events()` hands it over.
    `tensor_parallel_size`: split the model over that many processes
    (tensor_parallel.py; this one and N - 1 workers), one manager;
    `tensor_parallel_timeout`: seconds a collective (and the start) waits
    for the other ranks before it fails; `tensor_parallel_heartbeat_timeout`:
    seconds a worker may go without its heartbeat before it counts as hung
    (stopped, say): then every worker is stopped and the engine fails, in
    seconds rather than after the collective's timeout.
    `seed`: the draws of requests without a seed of their own; None
    (default): fresh entropy at each start, so a restart does not repeat
    them; a 64-bit integer: runs that add the same requests in the same
    order draw the same (seeding.py)."""

    model: str  # a Hugging Face folder, a .gguf file, or a folder holding one
    # -- the KV cache
    kv_cache_memory: int | str = "2GiB"  # bytes, "4GiB", or "auto" (85% of free GPU memory; 2GiB on the CPU)
    # Attention pages: "auto" (the model's dtype), one dtype ("int8", "fp8_e4m3", "fp8_e5m2", "bfloat16", ...)
    # or one per kind ({"full_attention": "int8", "sliding_window": "auto"}); docs/kv_dtypes.md
    kv_cache_dtype: str | dict | None = "auto"
    recurrent_state_dtype: str = "float32"  # or "bfloat16"; never quantized
    block_size: int | None = None  # tokens per block; None: the planner's choice (16, 64 with recurrent layers)
    enable_prefix_caching: bool = True
    checkpoint_policy: str = "hybridkv"  # when Mamba states are checkpointed (core/checkpoints.py)
    enable_kv_events: bool = False
    # -- tiers below the pool (tiers/)
    kv_host_cache_memory: int | str | None = None
    kv_disk_cache: str | None = None  # a directory
    kv_disk_cache_memory: int | str = "16GiB"
    kv_role: str | None = None  # None, "prefill" or "decode" (on a kv_disk_cache both engines read)
    # -- the scheduler
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # None: the model's context
    seed: int | None = None  # unseeded requests' draws; None: fresh entropy at each start
    # -- speculative decoding (speculative.py)
    speculative_method: str | None = None  # None or "ngram" (prompt lookup)
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # -- the model and how it runs
    dtype: str | None = None  # None: $HYBRIDKV_DTYPE, else "auto" (CPU: bfloat16 where native; layers/dtypes.py)
    device: str = "cpu"
    backend: str | None = None  # None: $HYBRIDKV_BACKEND, else "auto" (layers/backends/)
    enforce_eager: bool = False  # no CUDA graphs
    fixed_shape_decode: bool | None = None  # None: where CUDA graphs capture them
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 600.0  # seconds a collective waits for the other ranks
    tensor_parallel_heartbeat_timeout: float = 5.0  # seconds a worker may be silent before it counts as hung
    progress: bool = True  # progress bars while loading

    def __post_init__(self):
        self._check_model()
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        if self.block_size is not None:
            _positive("block_size", self.block_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        for name in ("tensor_parallel_timeout", "tensor_parallel_heartbeat_timeout"):
            _seconds(name, getattr(self, name))
        for name in ("enable_prefix_caching", "enable_kv_events", "enforce_eager", "progress"):
            _flag(name, getattr(self, name))
        if self.fixed_shape_decode is not None:
            _flag("fixed_shape_decode", self.fixed_shape_decode)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not -(1 << 63) <= seed < (1 << 63)):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63) or None, got {seed!r}")
        if self.kv_cache_memory != "auto":
            _memory("kv_cache_memory", self.kv_cache_memory)
        kv_cache_dtypes(self.kv_cache_dtype)
        if dtype_name(self.recurrent_state_dtype) not in RECURRENT_STATE_DTYPES:
            raise ValueError(f"recurrent_state_dtype must be one of {', '.join(RECURRENT_STATE_DTYPES)} (recurrent "
                             f"states are never quantized), got {self.recurrent_state_dtype!r}")
        get_policy(self.checkpoint_policy)
        self._check_tiers()
        self._check_speculative()
        self._check_runtime()

    def _check_model(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a model folder or a .gguf file path, got {self.model!r}")

    def _check_tiers(self) -> None:
        if self.kv_host_cache_memory is not None:
            _memory("kv_host_cache_memory", self.kv_host_cache_memory)
        if self.kv_disk_cache is not None and (not isinstance(self.kv_disk_cache, (str, os.PathLike))
                                               or not os.fspath(self.kv_disk_cache)):
            raise ValueError(f"kv_disk_cache must be a directory path or None, got {self.kv_disk_cache!r}")
        _memory("kv_disk_cache_memory", self.kv_disk_cache_memory)
        if self.tiers and not self.enable_prefix_caching:
            raise ValueError("KV cache tiers (kv_host_cache_memory, kv_disk_cache) need prefix caching")
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role must be None, 'prefill' or 'decode', got {self.kv_role!r}")
        if self.kv_role is not None and self.kv_disk_cache is None:
            raise ValueError(f"kv_role {self.kv_role!r} needs kv_disk_cache: the directory the prefill engine "
                             f"writes and the decode engine reads")

    def _check_speculative(self) -> None:
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be None or 'ngram' (prompt lookup), "
                             f"got {self.speculative_method!r}")
        if self.speculative_method is None:
            return
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    def _check_runtime(self) -> None:
        if not (self.dtype is None or self.dtype == "auto" or self.dtype in MODEL_DTYPES or isinstance(self.dtype, torch.dtype)):
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(map(repr, MODEL_DTYPES))}, "
                             f"got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must name a torch device ('cpu', 'cuda', 'cuda:1'), "
                             f"got {self.device!r}") from None
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")

    def check_machine(self) -> None:
        """What the options ask of the machine the engine runs on, checked
        before anything loads (by Engine, and by `hybridkv serve` where
        the engine runs on its machine): the device, a backend that runs
        on it, and budgets that fit its memory; a ValueError says which
        and why. The values alone are checked at construction, so that a
        config can be built for another machine (a Ray replica's)."""
        device = torch.device(self.device)
        if device.type != "cpu":
            kind = getattr(torch, device.type, None)  # torch.cuda, torch.mps, ...
            count = kind.device_count() if hasattr(kind, "is_available") and kind.is_available() else 0
            if count <= (device.index or 0):
                build = " (a CPU-only build)" if device.type == "cuda" and torch.version.cuda is None else ""
                raise ValueError(f"device {self.device!r}: this torch {torch.__version__}{build} sees "
                                 f"{count} {device.type} device(s)")
        check_backend(self.backend, device)
        # A budget larger than the memory it lives in would fail only once
        # the model is loaded (and planning a pool that large takes a while).
        total, available = _host_memory()
        for name in ("kv_cache_memory", "kv_host_cache_memory"):
            value = getattr(self, name)
            if value is None or value == "auto" or (name == "kv_cache_memory" and device.type != "cpu"):
                continue
            if parse_memory(value) > total:
                raise ValueError(f"{name} {value} is more than this machine's memory ({_gib(total)}, "
                                 f"{_gib(available)} of it available)")
        if device.type == "cuda" and self.kv_cache_memory != "auto":
            total = torch.cuda.get_device_properties(device).total_memory
            if parse_memory(self.kv_cache_memory) > total:
                raise ValueError(f"kv_cache_memory {self.kv_cache_memory} is more than {device}'s memory "
                                 f"({_gib(total)})")

    # -- what the options mean together ----------------------------------------
    @property
    def tiers(self) -> bool:
        """A host or disk tier below the pool."""
        return self.kv_host_cache_memory is not None or self.kv_disk_cache is not None

    @property
    def speculative(self) -> tuple[int, int, int] | None:
        """(drafts per step, shortest and longest n-gram matched), or None: off."""
        if self.speculative_method is None:
            return None
        return self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max

    @classmethod
    def build(cls, model, **options) -> "EngineConfig":
        """The config of `Engine(model, **options)`: `model` may already be
        a config (then `options` change it). An unknown option is a
        TypeError naming the nearest known one."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "model"]
        unknown = [name for name in options if name not in names]
        if unknown:
            near = difflib.get_close_matches(unknown[0], names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"unknown engine option {unknown[0]!r}{hint}; the options are: {', '.join(names)}")
        if isinstance(model, cls):
            return model.replace(**options) if options else model
        return cls(model, **options)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def options(self) -> dict:
        """Every option but the model, as keywords of `Engine(model, **options)`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine's memory, or of the
    container's where a cgroup limits it lower."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        total, available = info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):  # not Linux
        total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = int(f.read())  # "max": no limit, a ValueError
        total, available = min(total, limit), min(available, limit)
    except (OSError, ValueError):
        pass
    return total, available


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f} GiB"


def _memory(name: str, value) -> None:
    try:
        parse_memory(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
