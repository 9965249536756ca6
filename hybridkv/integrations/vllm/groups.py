"""vLLM's KV cache groups as hybridkv sees them: the layout, the keys, the
hit rule over the tiers, and the identity of what made the KV.

vLLM hands a connector its KV cache config: groups of layers, each with a
spec (full attention, sliding window, chunked local, Mamba, ...), over one
pool of block ids. `TierGroups.from_vllm` maps it onto a hybridkv layout:
one hybridkv group per vLLM group with the same read rule and block size,
and a page per layer, so a group's block is `width` pages (its layers'
slices of one block id): the shape hybridkv's tier storage keeps.

Keys are vLLM's own block hashes (SHA-256 chained over the prefix, the
request's cache_salt folded into the first): a group's block j is keyed by
the hash that ends at its last token. The hit is hybridkv's fixed point
over the groups' own rules (the N-type hit rule, docs/architecture.md; `fixed_point` in
core/coordinator.py and each manager's `longest_hit`), over masks saying,
per block position, whether the group can read it: below vLLM's local hit
the pool holds it (a longer hit reads, below the local hit, only blocks of
the local hit's own window, which vLLM keeps), from there on whether a tier
holds the key. vLLM then allocates, for the tokens the connector serves,
exactly the blocks each rule reads (null blocks before a window), and the
connector loads every one of them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from ...core.block_cache import BlockCache
from ...core.coordinator import fixed_point
from ...core.dtypes import MODEL_DTYPES, dtype_name
from ...core.layout import KVCacheGroup, KVCacheLayout
from ...core.managers import make_manager
from ...core.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec


def hybridkv_spec(spec):
    """The hybridkv spec with the read rule of vLLM group spec `spec`; a
    ValueError for the kinds the connector does not serve."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFull
    from vllm.v1.kv_cache_interface import KVQuantMode
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingWindow

    kind = type(spec)
    if kind.__name__ == "MambaSpec":
        raise ValueError("hybridkv's vLLM connector does not serve Mamba groups yet: vLLM 0.32's CPU build runs no "
                         "Mamba model with prefix caching (Jamba lacks its prefill kernel, Mamba-2 hybrids fail in "
                         "the checkpointing scan), so that path is untested; run this model without the connector")
    if kind not in (VllmFull, VllmSlidingWindow, ChunkedLocalAttentionSpec):
        raise ValueError(f"hybridkv's vLLM connector serves full, sliding-window and chunked-local attention "
                         f"groups; this model has a {kind.__name__} group")
    mode = spec.kv_quant_mode
    if mode == KVQuantMode.FP8_PER_TENSOR:
        # vLLM's fp8 pages (kv_cache_dtype fp8, fp8_e4m3, fp8_e5m2) hold one
        # byte of code per element and nothing else; the scale is one per
        # tensor, the checkpoint's or 1.0, kept in the layer. The tiers move
        # these pages as raw bytes (never as hybridkv's own narrow format,
        # which keeps a scale per token and head in the page), and the
        # identity names the dtype, so no engine of another dtype reads them.
        dtype = "uint8"
    elif mode != KVQuantMode.NONE:
        raise ValueError(f"hybridkv's vLLM connector does not serve vLLM's {mode.name} KV pages (stored as "
                         f"{spec.dtype}): it serves float pages and fp8 ones with a scale per tensor "
                         f"(kv_cache_dtype 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2': what vLLM's CPU build runs)")
    else:
        dtype = dtype_name(spec.dtype)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"hybridkv's vLLM connector does not know the KV dtype {spec.dtype}")
    if kind is VllmSlidingWindow:
        # Blocks kept below the window (extra_retained_tokens) are allocated
        # for a hit too: a wider window reads the same blocks.
        return SlidingWindowSpec(spec.num_kv_heads, spec.head_size, dtype,
                                 sliding_window=spec.sliding_window + spec.extra_retained_tokens)
    if kind is ChunkedLocalAttentionSpec:
        return ChunkedLocalSpec(spec.num_kv_heads, spec.head_size, dtype, chunk_size=spec.attention_chunk_size)
    # A full-attention spec that records a window (vLLM's hybrid allocator
    # off) keeps every block: full attention's rule.
    return FullAttentionSpec(spec.num_kv_heads, spec.head_size, dtype)


@dataclass
class TierGroups:
    layout: KVCacheLayout  # one hybridkv group per vLLM group; a page is one layer's slice of a block
    hash_stride: int  # vLLM block hashes per block (hashes may be finer than blocks)
    alignment: int  # a hit is a multiple of this many tokens
    vllm_specs: tuple[str, ...] = ()  # each group's vLLM spec, as repr: part of the KV's identity
    managers: list = field(init=False, repr=False)  # hybridkv's per-type managers: only their rules are used

    def __post_init__(self) -> None:
        rules = BlockCache(2, len(self.layout.groups))
        self.managers = [make_manager(g, rules, True, False, None) for g in self.layout.groups]

    @classmethod
    def from_vllm(cls, kv_cache_config) -> TierGroups:
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("hybridkv's vLLM connector needs a model with a KV cache")
        specs = [hybridkv_spec(g.kv_cache_spec) for g in groups]
        sizes = sorted({g.kv_cache_spec.block_size for g in groups})
        if len(sizes) != 1:
            raise ValueError(f"hybridkv's vLLM connector needs one block size for every KV cache group; "
                             f"this model's groups have {sizes}")
        pages = sorted({g.kv_cache_spec.page_size_bytes for g in groups})
        if len(pages) != 1:
            raise ValueError(f"hybridkv's vLLM connector needs one page size for every KV cache group; "
                             f"this model's groups have {pages} bytes")
        block, page = sizes[0], pages[0]
        hash_block = kv_cache_config.hash_block_size or block
        if block % hash_block:
            raise ValueError(f"vLLM's hash block size {hash_block} does not divide the block size {block}")
        alignment = math.lcm(kv_cache_config.cache_hit_alignment_tokens or block, block)  # whole blocks
        layout = KVCacheLayout(
            groups=tuple(KVCacheGroup(index=i, spec=spec, layer_names=tuple(g.layer_names), block_size=block,
                                      pages_per_block=len(g.layer_names), block_bytes=len(g.layer_names) * page,
                                      layer_bytes=page)
                         for i, (g, spec) in enumerate(zip(groups, specs))),
            page_size_bytes=page, num_pages=kv_cache_config.num_blocks, block_size=block,
            memory_bytes=kv_cache_config.num_blocks * page, layer_views={})
        return cls(layout, block // hash_block, alignment, tuple(repr(g.kv_cache_spec) for g in groups))

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def kinds(self) -> list[str]:
        return [g.kind for g in self.layout.groups]

    def keys(self, block_hashes, num_blocks: int) -> list:
        """The keys of a request's first `num_blocks` blocks (fewer if it has
        fewer whole blocks hashed): block j's is the hash ending at its last
        token."""
        stride = self.hash_stride
        return list(block_hashes[stride - 1:stride * num_blocks:stride])

    def hit(self, keys: list, local: int, held: list) -> int:
        """The longest hit in blocks (at least `local`, vLLM's own hit, when
        it is no longer than the keys): every group reads each block that
        its rule needs from the pool (below `local`) or from `held[g]`, the
        keys the tiers hold for group g."""
        if len(keys) <= local:
            return local
        head = b"\x01" * local
        masks = [head + bytes(map(held[g].__contains__, keys[local:])) for g in range(len(self.managers))]
        blocks = fixed_point(self.managers, masks, len(keys))
        step = self.alignment // self.block_size
        return max(local, blocks - blocks % step)

    def first_needed(self, group: int, hit_blocks: int) -> int:
        """The first block position group `group` reads for a hit of
        `hit_blocks` blocks (vLLM allocates null blocks before it)."""
        return self.managers[group].hit_start(hit_blocks)


def identity(vllm_config, groups: TierGroups, rank: int = 0) -> bytes:
    """What made the KV the disk tier keeps, as hybridkv's `kv_identity`
    digests it: every byte of the weights (the model folder's weight,
    config and tokenizer files, or a single-file checkpoint, and a
    tokenizer folder of its own), the model dtype, the layout, and what else
    changes the KV or its keys: vLLM's version, the KV cache dtype, the
    quantization, the groups' vLLM specs, the hash algorithm, and this
    worker's rank among the tensor-parallel shards. Another model, version
    or layout never reads these files (its identity names another folder).
    """
    import vllm

    from ...core.identity import file_digest, weights_fingerprint
    from ...tiers import kv_identity

    model_config, cache_config, parallel = (vllm_config.model_config, vllm_config.cache_config,
                                            vllm_config.parallel_config)
    path = _weights_path(model_config.model, model_config.revision)
    extra = {
        # A hub id names the weights only where the local cache has none to
        # fingerprint; a local folder is its files, wherever it lies.
        "engine": "vllm", "version": vllm.__version__, "model": None if path else model_config.model,
        "revision": model_config.revision, "quantization": model_config.quantization,
        "kv_cache_dtype": str(cache_config.cache_dtype), "hash": str(cache_config.prefix_caching_hash_algo),
        "specs": list(groups.vllm_specs),
        "rank": rank, "tensor_parallel": parallel.tensor_parallel_size,
        "pipeline_parallel": parallel.pipeline_parallel_size,
    }
    if os.path.isfile(path):  # a single-file checkpoint (GGUF)
        extra["file"] = [os.path.basename(path), os.path.getsize(path), file_digest(path)]
        path = ""
    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer and tokenizer != model_config.model:  # the ids a text becomes come from there
        folder = _weights_path(tokenizer, getattr(model_config, "tokenizer_revision", None))
        extra["tokenizer"] = weights_fingerprint(folder) if os.path.isdir(folder) else tokenizer
    return kv_identity(path, str(model_config.dtype).removeprefix("torch."), groups.layout,
                       json.dumps(extra, sort_keys=True, default=str))


def _weights_path(model: str, revision: str | None) -> str:
    """A local folder or file for `model`: itself, or the Hugging Face
    cache's snapshot of that revision (its weight files then name the
    exact weights); "" if neither is found (the name and revision alone
    then stand for the weights)."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, offline, not a hub id: fall back to the name
        return ""

