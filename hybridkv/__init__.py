"""hybridkv: paged KV cache for hybrid LLMs, and an engine that serves them.

`import hybridkv` stays light: the core names load eagerly (no torch), the
engine names (Engine, EngineConfig, SamplingParams) load on first use.
"""

from .core import (ChunkedLocalSpec, FullAttentionSpec, KVCacheLayout, KVCacheManager, MambaSpec,
                   RecurrentSpec, SlidingWindowSpec, plan_layout)

from .core.version import VERSION as __version__

_LAZY = {
    "Engine": ("hybridkv.engine.engine", "Engine"),
    "EngineConfig": ("hybridkv.engine.config", "EngineConfig"),
    "SamplingParams": ("hybridkv.engine.sampling_params", "SamplingParams"),
    "RequestOutput": ("hybridkv.engine.outputs", "RequestOutput"),
    "CompletionOutput": ("hybridkv.engine.outputs", "CompletionOutput"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybridkv' has no attribute {name!r}")


__all__ = ["ChunkedLocalSpec", "Engine", "EngineConfig", "FullAttentionSpec", "KVCacheLayout", "KVCacheManager",
           "MambaSpec", "RecurrentSpec", "SamplingParams", "SlidingWindowSpec", "plan_layout"]
