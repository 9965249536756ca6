"""The KV cache memory: one byte buffer of `num_pages` pages, allocated once
from the layout, and the typed views each layer takes of it."""

from __future__ import annotations

import torch

from ..core.layout import KVCacheLayout

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
                "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
                "float8_e5m2": getattr(torch, "float8_e5m2", None)}


class KVBuffers:
    def __init__(self, layout: KVCacheLayout, device: torch.device | str = "cpu"):
        self.layout = layout
        self.page_size = layout.page_size_bytes
        # Zeroed: positions a query may not read are masked, and masked values
        # must still be finite (0 * NaN would poison the weighted sum).
        self.pool = torch.zeros(layout.num_pages, self.page_size, dtype=torch.uint8, device=device)
        self._attention: dict[str, torch.Tensor] = {}
        for name, view in layout.layer_views.items():
            group = layout.groups[view.group]
            if group.kind == "mamba":
                continue
            spec = group.spec
            dtype = TORCH_DTYPES[spec.dtype]
            raw = self.pool[:, view.offset:view.offset + group.layer_bytes]
            self._attention[name] = raw.view(dtype).view(
                layout.num_pages, 2, group.block_size, spec.num_kv_heads, spec.head_size)

    def attention_cache(self, layer_name: str) -> torch.Tensor:
        """[num_pages, 2 (K, V), block_size, kv_heads, head_dim], a view of the pool."""
        return self._attention[layer_name]

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write after a fork: whole pages, every layer on them."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.pool.device)
            dst = torch.tensor([d for _, d in pairs], device=self.pool.device)
            self.pool[dst] = self.pool[src]

    # -- recurrent states --------------------------------------------------
    def gather_states(self, read_pages: torch.Tensor, zero_rows: torch.Tensor | None) -> torch.Tensor:
        """The states of R requests as one byte tensor [R, width * page]
        (rows in `zero_rows` start from the zero state)."""
        rows = read_pages.shape[0]
        flat = self.pool[read_pages].reshape(rows, -1)
        if zero_rows is not None:
            flat[zero_rows] = 0
        return flat

    def scatter_states(self, write_pages: torch.Tensor, flat: torch.Tensor) -> None:
        self.pool[write_pages] = flat.view(write_pages.shape[0], write_pages.shape[1], self.page_size)

    def state_views(self, flat: torch.Tensor, layer_name: str) -> list[torch.Tensor]:
        """Typed views of one layer's state parts inside gathered states:
        one tensor [R, *shape] per part (e.g. conv, ssm)."""
        view = self.layout.layer_views[layer_name]
        spec = self.layout.groups[view.group].spec
        out = []
        for part_offset, shape, dtype, nbytes in zip(view.part_offsets, spec.shapes, spec.dtypes, spec.part_bytes):
            start = view.offset + part_offset
            out.append(flat[:, start:start + nbytes].view(TORCH_DTYPES[dtype]).view(flat.shape[0], *shape))
        return out
