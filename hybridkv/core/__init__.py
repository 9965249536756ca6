"""The manager core: specs, layout planning, block pool, hashing, per-type
managers, coordinator and KVCacheManager. Pure Python (no torch), so engine
builders can import it into their own scheduler."""

from .block_pool import NULL, BlockPool
from .checkpoints import POLICIES, CheckpointPolicy
from .hashing import BlockHasher
from .kv_cache_manager import CacheStats, KVCacheManager, UnknownRequestError
from .layout import KVCacheGroup, KVCacheLayout, LayerView, parse_memory, plan_layout
from .specs import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "NULL", "BlockPool", "BlockHasher", "CacheStats", "CheckpointPolicy", "ChunkedLocalSpec",
    "FullAttentionSpec", "KVCacheGroup", "KVCacheLayout", "KVCacheManager", "LayerView", "MambaSpec",
    "POLICIES", "SlidingWindowSpec", "UnknownRequestError", "parse_memory", "plan_layout",
]
