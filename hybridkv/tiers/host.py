"""The host tier: blocks in host memory."""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    """Blocks in host memory: one slab of pages (pinned when the pool is on
    a GPU, so copies go by DMA), an LRU of blocks, a free list of pages."""

    def __init__(self, num_pages: int, page_size: int, pin: bool):
        self.slab = torch.empty(num_pages, page_size, dtype=torch.uint8, pin_memory=pin)
        self.free = list(range(num_pages - 1, -1, -1))
        self.blocks: OrderedDict[tuple, list[int]] = OrderedDict()  # (group, key) -> slab pages

    def __contains__(self, item) -> bool:
        return item in self.blocks

    def add(self, item, content: torch.Tensor) -> list:
        """Keep `content` ([width, page size]); returns the blocks pushed
        out to make room, as (item, content)."""
        width = content.shape[0]
        if width > self.slab.shape[0]:
            return [(item, content)]  # larger than the whole tier
        pushed = []
        while len(self.free) < width:
            old, pages = self.blocks.popitem(last=False)
            pushed.append((old, self.slab[pages].clone()))
            self.free.extend(pages)
        pages = [self.free.pop() for _ in range(width)]
        self.slab[pages] = content
        self.blocks[item] = pages
        return pushed

    def get(self, item) -> torch.Tensor | None:
        pages = self.blocks.get(item)
        if pages is None:
            return None
        self.blocks.move_to_end(item)
        return self.slab[pages].clone()

    def touch(self, item) -> None:
        self.blocks.move_to_end(item)

    def remove(self, item) -> None:
        pages = self.blocks.pop(item, None)
        if pages is not None:
            self.free.extend(pages)

    def clear(self) -> None:
        for pages in self.blocks.values():
            self.free.extend(pages)
        self.blocks.clear()
