"""One manager per KV cache group, each knowing one layer type's rules."""

from .base import AttentionManager, GroupManager
from .chunked_local import ChunkedLocalManager
from .full_attention import FullAttentionManager
from .mamba import MambaManager
from .sliding_window import SlidingWindowManager

MANAGER_TYPES = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalManager,
}


def make_manager(group, block_cache, caching, verify, planner) -> GroupManager:
    """The manager of a group's type. `planner`: the model's checkpoint
    planner, for groups that keep recurrent states."""
    if group.recurrent:
        return MambaManager(group, block_cache, caching, verify, planner)
    return MANAGER_TYPES[group.kind](group, block_cache, caching, verify)


__all__ = ["GroupManager", "AttentionManager", "FullAttentionManager", "SlidingWindowManager",
           "ChunkedLocalManager", "MambaManager", "make_manager"]
