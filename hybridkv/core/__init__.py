"""The manager core: specs, layout planning, block pool, hashing, per-type
managers, coordinator and KVCacheManager. Pure Python (no torch), so engine
builders can import it into their own scheduler."""

from .block_pool import NULL, BlockPool
from .checkpoints import POLICIES, CheckpointPolicy
from .hashing import BlockHasher
from .coordinator import Coordinator, HybridCoordinator, UnitaryCoordinator, make_coordinator
from .kv_cache_manager import CacheStats, GroupHit, HitExplanation, KVCacheManager, UnknownRequestError
from .layout import KVCacheGroup, KVCacheLayout, LayerView, parse_memory, plan_layout
from .specs import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "NULL", "BlockPool", "BlockHasher", "CacheStats", "CheckpointPolicy", "ChunkedLocalSpec", "Coordinator",
    "FullAttentionSpec", "GroupHit", "HitExplanation", "HybridCoordinator", "KVCacheGroup", "KVCacheLayout",
    "KVCacheManager", "LayerView", "MambaSpec", "POLICIES", "SlidingWindowSpec", "UnitaryCoordinator",
    "UnknownRequestError", "make_coordinator", "parse_memory", "plan_layout",
]
