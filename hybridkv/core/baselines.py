"""Memory per request under other cache designs, for comparison with the
planned layout (benchmarks/memory.py, `hybridkv plan --plot`). All in bytes,
for a request holding `tokens` tokens, decoding one token per step.

* exact: what the layers must keep to go on (full: every token; sliding
  window W: the last W - 1; chunked local C: the current chunk; Mamba: one
  state), nothing rounded.
* contiguous: a per-request cache sized for the longest context `max_tokens`
  whatever the request's length, as a static cache does; with
  `cap_windows` (the default) sliding layers keep only their window, as
  transformers' caches do; without it every layer holds `max_tokens`.
* padded groups: the grouping vLLM documents: every group holds as many
  layers as the smallest layer type (padding layers added to fill the last
  group of a type), all groups share one page size, and when a Mamba state is
  larger than an attention page the attention block size is raised until the
  page holds one state.
"""

from __future__ import annotations

import math
import random

from .layout import KVCacheLayout
from .specs import AttentionSpec, LayerSpec


def length_mix(max_tokens: int, n: int = 2000, seed: int = 0) -> list[int]:
    """A realistic mix of request lengths up to `max_tokens`: log-uniform in
    [64, max_tokens], so many short requests and a few long ones."""
    rng = random.Random(seed)
    low = math.log(64)
    return [int(math.exp(rng.uniform(low, math.log(max(65, max_tokens))))) for _ in range(n)]


def mean_bytes(per_request, lengths: list[int]) -> float:
    return sum(per_request(t) for t in lengths) / len(lengths)


def _by_spec(specs: dict[str, LayerSpec]) -> dict[LayerSpec, int]:
    counts: dict[LayerSpec, int] = {}
    for spec in specs.values():
        counts[spec] = counts.get(spec, 0) + 1
    return counts


def _kept_tokens(spec: AttentionSpec, tokens: int) -> int:
    """Keys the next query (at position `tokens`) reads, besides its own."""
    return tokens - spec.first_visible(tokens)


def exact_bytes(specs: dict[str, LayerSpec], tokens: int) -> int:
    total = 0
    for spec, count in _by_spec(specs).items():
        if spec.recurrent:
            total += count * spec.state_bytes
        else:
            total += count * _kept_tokens(spec, tokens) * spec.bytes_per_token
    return total


def contiguous_bytes(specs: dict[str, LayerSpec], max_tokens: int, cap_windows: bool = True) -> int:
    total = 0
    for spec, count in _by_spec(specs).items():
        if spec.recurrent:
            total += count * spec.state_bytes
        elif spec.kind == "sliding_window" and cap_windows:
            total += count * min(max_tokens, spec.sliding_window) * spec.bytes_per_token
        else:
            total += count * max_tokens * spec.bytes_per_token
    return total


def hybridkv_bytes(layout: KVCacheLayout, tokens: int) -> int:
    return layout.pages_per_request(tokens) * layout.page_size_bytes


class PaddedGroups:
    """The padded equal-size grouping, planned for the same specs."""

    def __init__(self, specs: dict[str, LayerSpec], block_size: int = 16):
        counts = self._counts = _by_spec(specs)
        self.group_layers = min(counts.values())
        self.groups: list[tuple[LayerSpec, int]] = []  # (spec, number of groups)
        for spec, count in counts.items():
            self.groups.append((spec, math.ceil(count / self.group_layers)))
        self.padding_layers = sum(n * self.group_layers for _, n in self.groups) - sum(counts.values())
        attention = [s for s, _ in self.groups if not s.recurrent]
        states = [s.state_bytes for s, _ in self.groups if s.recurrent]
        per_token = max((s.bytes_per_token for s in attention), default=0) * self.group_layers
        self.block_size = block_size
        if states and per_token:
            # One page must hold a state of group_layers Mamba layers.
            need = max(states) * self.group_layers
            self.block_size = max(block_size, math.ceil(need / per_token / block_size) * block_size)
        self.page_bytes = max([per_token * self.block_size] + [s * self.group_layers for s in states])

    def bytes_per_request(self, tokens: int) -> int:
        pages = 0
        bs = self.block_size
        for spec, groups in self.groups:
            if spec.recurrent:
                blocks = 1
            else:
                all_blocks = math.ceil(tokens / bs)
                if spec.kind == "sliding_window":
                    blocks = min(all_blocks, math.ceil(spec.sliding_window / bs) + 1)
                elif spec.kind == "chunked_local":
                    blocks = min(all_blocks, math.ceil((spec.chunk_size + 1) / bs) + 1)
                else:
                    blocks = all_blocks
            pages += groups * blocks
        return pages * self.page_bytes

    def waste_fraction(self) -> float:
        """Share of each set of pages (one per group) that no layer uses:
        padding layers, and pages larger than a group's layers need."""
        real = alloc = 0
        for spec, groups in self.groups:
            count = self._counts[spec]
            if spec.recurrent:
                real += count * spec.state_bytes
            else:
                real += count * spec.bytes_per_token * self.block_size
            alloc += groups * self.page_bytes
        return 1.0 - real / alloc
