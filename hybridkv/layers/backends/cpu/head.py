"""The LM head of small bfloat16 decode steps on the CPU's own bfloat16 dot
product (kernels.c `head_products`), swapped in by the cpu backend.

Why: a batch-1 step of a small model with a large vocabulary reads the LM
head more than anything else (Gemma-3 270M: 335 MB of its 511 MB of
weights), so the rate at which the head's product reads its weight sets
the step. On a Xeon with AMX, oneDNN's bfloat16 product over the packed
head read it at 13.6 GB/s at one to eleven rows (24.6 ms), where a
sum over as many bytes ran at 18-20 GB/s; the C product over the weight
laid out in tiles (decoder.py `tiles`, the one-call layers' layout) read
it at ~20 GB/s (16.7 ms). Bigger steps (MAX_ROWS) keep oneDNN's packed
product: there its AMX tiles do arithmetic the dot product cannot keep up
with.

The tiled copy costs the head's size once more, beside the dense weight
the embedding reads and oneDNN's packed copy: it is made only where four
times that is free (the prepare report says which).
"""

from __future__ import annotations

import functools

import torch

from ..swap import twin
from .decoder import tiles
from .linear import OneDNNLinear, spare_memory


# The most rows of a step the C product takes. Batch-B decode steps of the
# real Gemma-3 270M in bfloat16, the two heads taking turns in one engine
# (4 rounds, Xeon with AMX, 2 cores): C over oneDNN 1.27-1.44x faster at
# 1 row, 1.20-1.44x at 4, 0.95-1.11x at 6, 0.87-0.95x at 8, 0.61-0.84x at 11.
MAX_ROWS = 5


class TiledHead(OneDNNLinear):
    lib = None  # the kernels
    tiles: torch.Tensor | None = None  # the weight in tiles
    max_rows = 0  # the most rows the C product takes; more run oneDNN's

    def product(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > self.max_rows or flat.dtype != torch.bfloat16:
            return super().product(x)
        flat = flat.contiguous()
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.bfloat16)
        status = self.lib.head_products(flat.data_ptr(), flat.shape[0], flat.shape[1], self.tiles.data_ptr(),
                                        self.out_features, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"hybridkv's C LM head refused a step of {flat.shape[0]} rows (status {status})")
        return out.view(*x.shape[:-1], self.out_features)


@functools.cache
def tiled_class(kind: type) -> type:
    """The TiledHead of a OneDNNLinear class (the LM head's: its forward,
    the product aside, its own)."""
    return TiledHead if kind is OneDNNLinear else type(f"Tiled{kind.__name__}", (TiledHead, kind), {})


def tile_head(model, lib, decoder_rows: int, report) -> bool:
    """The model's LM head (`lm_head`, a OneDNNLinear on one rank, no bias,
    whose dense weight packing kept: a head tied to the embedding) as a
    TiledHead for steps of up to MAX_ROWS rows, where its weight is
    bfloat16, the CPU has the bfloat16 dot product, the decoder layers run
    as one C call on such steps (`decoder_rows`: their most rows, 0 for
    none) and memory allows. True where swapped."""
    max_rows = min(MAX_ROWS, decoder_rows)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, OneDNNLinear) or isinstance(head, TiledHead) or max_rows <= 0 or \
            getattr(getattr(head, "ranks", None), "world", 1) != 1:
        return False  # (a head cut over ranks, or no one-call layers: nothing said, nothing to gain)
    weight = head.weight
    if weight.dtype != torch.bfloat16 or not lib.native_bf16_products or head.bias is not None or \
            weight.numel() == 0:
        return False
    size = weight.numel() * weight.element_size()
    if spare_memory() < 4 * size:
        report.declined.append(f"the LM head's C product on small steps: its tiled copy ({size / 2**20:.0f} MiB) "
                               f"needs 4x that free; oneDNN reads it")
        return False
    with torch.no_grad():
        tiled = tiles(weight.detach())
    model.lm_head = twin(tiled_class(type(head)), head, lib=lib, tiles=tiled, max_rows=max_rows)
    report.done.append(f"the LM head runs C products over a tiled copy ({size / 2**20:.0f} MiB) on steps of up to "
                       f"{max_rows} rows, oneDNN's above")
    return True
