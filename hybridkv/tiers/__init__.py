"""Storage for the blocks a pool lets go: host memory and disk
(docs/architecture.md, "Tiers below the pool"). Below the engine and the integrations, which both use it;
it decides nothing (the scheduler's index does: core/tiers.py)."""

from .disk import FORMAT_VERSION, DiskTier, has_block, kv_identities, kv_identity, list_blocks
from .host import HostTier
from .store import TierStore

__all__ = ["FORMAT_VERSION", "DiskTier", "HostTier", "TierStore", "has_block", "kv_identities", "kv_identity",
           "list_blocks"]
