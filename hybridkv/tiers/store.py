"""The tiers below one pool, as storage: host memory, then disk (either
may be off). A block the owner keeps goes to host memory; what host memory
pushes out goes to disk; with no host tier, straight to disk. A read gives
the content back, or None where the block is gone (a budget, a damaged
file: then it is removed).

It decides nothing and knows no pool: a scheduler decides from its own
index of what the tiers hold (core/tiers.py `TierIndex`), a worker copies
pages in and out (engine/tier_copies.py, the vLLM connector's worker).
Every change of what it holds is recorded, in order, as a move
`(group, key, "host" | "disk" | None)` for the owner to report
(`take_moves`), so the index follows.
"""

from __future__ import annotations

import torch

from .disk import DiskTier
from .host import HostTier


class TierStore:
    def __init__(self, page_size: int, num_groups: int, *, host_bytes: int = 0, disk_dir: str | None = None,
                 disk_bytes: int = 0, identity: bytes | None = None, pin: bool = False):
        # `pin`: pin the host slab (DMA copies to and from a GPU's pool).
        self.page_size = page_size
        self.host = HostTier(host_bytes // page_size, page_size, pin) if host_bytes >= page_size else None
        self.disk = DiskTier(disk_dir, identity, page_size, disk_bytes) if disk_dir else None
        self.moves: list[tuple] = []
        self.counters = {"stores": 0, "loads": 0, "store_bytes": 0, "load_bytes": 0, "evictions": 0}
        self.store_bytes_by_group = [0] * num_groups  # what each layer type costs the tiers
        self.load_seconds = 0.0  # reading blocks back into the pool (the owner's copies add to it)

    @property
    def first_tier(self) -> str:
        """Where a block kept now goes."""
        return "host" if self.host is not None else "disk"

    def where(self, item) -> str | None:
        if self.host is not None and item in self.host:
            return "host"
        if self.disk is not None and item in self.disk.files:
            return "disk"
        return None

    def held(self) -> list[tuple[int, bytes, str]]:
        """(group, key, tier) of every block held now."""
        out = [(g, k, "host") for g, k in self.host.blocks] if self.host is not None else []
        if self.disk is not None:
            out += [(g, k, "disk") for g, k in self.disk.files if self.where((g, k)) == "disk"]
        return out

    def keep(self, group: int, key: bytes, content: torch.Tensor) -> None:
        """Keep a block's content ([width, page size] bytes, on the host):
        host memory, else disk."""
        self.counters["stores"] += 1
        self.counters["store_bytes"] += content.numel()
        self.store_bytes_by_group[group] += content.numel()
        item = (group, key)
        if self.host is None:
            self._to_disk(item, content)
            return
        if item in self.host:
            self.host.touch(item)
            return
        for pushed, pushed_content in self.host.add(item, content):
            self._to_disk(pushed, pushed_content)
        self._moved(item)

    def _to_disk(self, item, content: torch.Tensor) -> None:
        """A block leaving host memory (or, with none, the pool) goes to disk
        if there is one."""
        if self.disk is not None:
            for old in self.disk.write(*item, content):
                self._moved(old)
        self._moved(item)

    def _moved(self, item) -> None:
        tier = self.where(item)
        if tier is None:
            self.counters["evictions"] += 1
        self.moves.append((item[0], item[1], tier))

    def read(self, group: int, key: bytes) -> torch.Tensor | None:
        """The block's pages, or None if no tier holds it whole (a damaged
        file is removed); a None is recorded as a move too, so an index
        that still had the block drops it."""
        item = (group, key)
        content = self.host.get(item) if self.host is not None else None
        if content is None and self.disk is not None:  # (a file another process wrote is read too)
            content = self.disk.read(group, key)
        if content is None:
            self.moves.append((group, key, None))
            return None
        self.counters["loads"] += 1
        self.counters["load_bytes"] += content.numel()
        return content

    def drop(self, group: int, key: bytes) -> None:
        """Forget a block in every tier (a rank's load of it failed
        somewhere: no rank keeps what the scheduler's index dropped)."""
        item = (group, key)
        held = self.where(item) is not None
        if self.host is not None and item in self.host:
            self.host.remove(item)
        if self.disk is not None:
            self.disk.remove(item)
        if held:
            self._moved(item)

    def write_disk(self, group: int, key: bytes, content: torch.Tensor) -> bool:
        """Write a block to disk now, whatever host memory holds (a server
        about to stop: the next start hits it). True if the disk holds it."""
        item = (group, key)
        if self.disk is None:
            return False
        if item not in self.disk.files:
            self._to_disk(item, content)
        return item in self.disk.files

    def clear(self) -> None:
        """Forget everything (the weights changed). Not recorded as moves:
        whoever clears clears its index too."""
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def take_moves(self) -> list[tuple]:
        moves, self.moves = self.moves, []
        return moves

    def describe(self) -> dict:
        """Sizes and counters, for stats and metrics."""
        out = dict(self.counters)
        out["store_bytes_by_group"] = list(self.store_bytes_by_group)
        out["load_seconds"] = self.load_seconds
        if self.host is not None:
            out["host_blocks"] = len(self.host.blocks)
            out["host_bytes_used"] = (self.host.slab.shape[0] - len(self.host.free)) * self.host.slab.shape[1]
            out["host_capacity_bytes"] = self.host.slab.numel()
        if self.disk is not None:
            out.update({f"disk_{k}": v for k, v in self.disk.describe().items()})
        return out
