"""The connector's options: vLLM's `kv_connector_extra_config`, checked once.

    {"host_memory": "4GiB",           host-memory tier budget (0 or absent: none)
     "disk_dir": "/var/cache/kv",     disk tier directory (absent: none)
     "disk_memory": "64GiB",          disk tier budget (default 16GiB)
     "lookahead_blocks": 2048}        free-queue blocks checked per step for
                                      blocks about to be evicted (default: what
                                      one step can allocate)

Sizes are bytes or strings like "4GiB" (hybridkv's `parse_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...core.layout import parse_memory

DEFAULT_DISK_MEMORY = 16 << 30
KNOWN = ("host_memory", "disk_dir", "disk_memory", "lookahead_blocks")


@dataclass(frozen=True)
class TierOptions:
    host_memory: int = 0
    disk_dir: str | None = None
    disk_memory: int = DEFAULT_DISK_MEMORY
    lookahead_blocks: int | None = None

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> TierOptions:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KNOWN))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config option(s) {unknown} for hybridkv's connector; "
                             f"known: {list(KNOWN)}")
        host = extra.get("host_memory")
        disk_dir = extra.get("disk_dir")
        if not host and not disk_dir:
            raise ValueError("hybridkv's connector needs a tier: set kv_connector_extra_config's "
                             "'host_memory' (e.g. \"4GiB\") and/or 'disk_dir' (a directory)")
        if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir):
            raise ValueError(f"kv_connector_extra_config 'disk_dir' must be a directory path, got {disk_dir!r}")
        lookahead = extra.get("lookahead_blocks")
        if lookahead is not None and (isinstance(lookahead, bool) or not isinstance(lookahead, int)
                                      or lookahead < 0):
            raise ValueError(f"kv_connector_extra_config 'lookahead_blocks' must be a count >= 0, got {lookahead!r}")
        return cls(host_memory=parse_memory(host) if host else 0, disk_dir=disk_dir,
                   disk_memory=parse_memory(extra.get("disk_memory", DEFAULT_DISK_MEMORY)),
                   lookahead_blocks=lookahead)
