"""The KV cache memory: one byte buffer of pages, allocated once from the
layout, and the typed views each layer takes of it.

Besides the layout's `num_pages` pages (page 0 the null page), a few sink
pages follow at the end (`sink_page(column)`): the padded rows of a
fixed-shape decode step write their K/V and Mamba states there, so that
padding never touches a page a real request reads, the null page included
(a masked read of the null page must find finite values)."""

from __future__ import annotations

import torch

from ..core.layout import KVCacheLayout
from .dtypes import TORCH_DTYPES
from .kv_quant import QuantizedCache


class KVBuffers:
    def __init__(self, layout: KVCacheLayout, device: torch.device | str = "cpu"):
        self.layout = layout
        self.page_size = layout.page_size_bytes
        self.num_sink_pages = max((g.pages_per_block for g in layout.groups), default=1)
        rows = layout.num_pages + self.num_sink_pages
        # Zeroed: positions a query may not read are masked, and masked values
        # must still be finite (0 * NaN would poison the weighted sum).
        self.pool = torch.zeros(rows, self.page_size, dtype=torch.uint8, device=device)

    def sink_page(self, column: int = 0) -> int:
        """A page no table of a real request names: padding writes here."""
        return self.layout.num_pages + column

    def attention_cache(self, layer_name: str, piece: int = 0) -> torch.Tensor | QuantizedCache:
        """[pages, 2 (K, V), block_size, kv_heads, head_dim], a view of the
        pool; for a quantized layer its codes so and its scales [pages, 2,
        block_size, kv_heads] (kv_quant.py). Where the layout packs the
        group's heads (LayerView.runs), piece `piece` of the layer's block:
        its heads only, laid out alike, in its own page column; where it
        keeps the group's scales apart, they are read through the table of
        their own column (`QuantizedCache.scale_column`). Made when asked
        (a few view ops), so that a traced or captured step has the pool as
        its one cache input rather than many aliased views."""
        view = self.layout.layer_views[layer_name]
        group = self.layout.groups[view.group]
        spec = group.spec
        _, offset, heads = view.places[piece]
        heads = heads or spec.num_kv_heads
        shape = (self.pool.shape[0], 2, group.block_size, heads)
        if not spec.quantized:
            raw = self.pool[:, offset:offset + heads * group.head_bytes]
            return raw.view(TORCH_DTYPES[spec.dtype]).view(*shape, spec.head_size)
        codes = group.code_head_bytes * heads
        if group.scales_apart:
            scale_column, scale_offset = view.scale_runs[piece]
            scales = self.pool[:, scale_offset:scale_offset + (group.head_bytes - group.code_head_bytes) * heads]
        else:
            scale_column, scales = None, self.pool[:, offset + codes:offset + heads * group.head_bytes]
        return QuantizedCache(self.pool[:, offset:offset + codes].view(TORCH_DTYPES[spec.dtype]).view(
            *shape, spec.head_size), scales.view(torch.float32).view(shape), scale_column=scale_column)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write after a fork: whole pages, every layer on them."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.pool.device)
            dst = torch.tensor([d for _, d in pairs], device=self.pool.device)
            self.pool[dst] = self.pool[src]

    def state_views(self, flat: torch.Tensor, layer_name: str) -> list[torch.Tensor]:
        """Typed views of one layer's state parts inside gathered states
        (`[R, state bytes]`): one tensor `[R, *shape]` per part (conv, ssm)."""
        view = self.layout.layer_views[layer_name]
        spec = self.layout.groups[view.group].spec
        out = []
        for part_offset, shape, dtype, nbytes in zip(view.part_offsets, spec.shapes, spec.dtypes, spec.part_bytes):
            start = view.offset + part_offset
            out.append(flat[:, start:start + nbytes].view(TORCH_DTYPES[dtype]).view(flat.shape[0], *shape))
        return out
