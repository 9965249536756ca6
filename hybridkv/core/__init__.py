"""The manager core: specs, layout planning, the page allocator and the
block cache, hashing, per-type managers, coordinator and KVCacheManager. Pure Python (no torch), so engine
builders can import it into their own scheduler."""

from .block_cache import BlockCache
from .page_allocator import NULL, PageAllocator
from .request import NO_FAST_PATH, FastPath
from .checkpoints import POLICIES, CheckpointPolicy
from .hashing import BlockHasher
from .coordinator import Coordinator, HybridCoordinator, UnitaryCoordinator, make_coordinator
from .kv_cache_manager import CacheStats, GroupHit, HitExplanation, KVCacheManager, UnknownRequestError
from .layout import KVCacheGroup, KVCacheLayout, LayerView, parse_memory, plan_layout
from .specs import RECURRENT_KINDS, ChunkedLocalSpec, FullAttentionSpec, MambaSpec, RecurrentSpec, SlidingWindowSpec

__all__ = [
    "NULL", "BlockCache", "BlockHasher", "CacheStats", "CheckpointPolicy", "ChunkedLocalSpec", "Coordinator", "FastPath", "NO_FAST_PATH",
    "FullAttentionSpec", "GroupHit", "HitExplanation", "HybridCoordinator", "KVCacheGroup", "KVCacheLayout",
    "KVCacheManager", "LayerView", "MambaSpec", "POLICIES", "PageAllocator", "RECURRENT_KINDS", "RecurrentSpec",
    "SlidingWindowSpec", "UnitaryCoordinator",
    "UnknownRequestError", "make_coordinator", "parse_memory", "plan_layout",
]
