"""KV events as bytes, in vLLM's KV event wire format, so that a router
built for vLLM's event stream (llm-d's KV cache indexer, Dynamo's KV
router, or a PrefixIndex) reads a hybridkv engine's events.

The format (vLLM 0.32, `vllm/distributed/kv_events.py`), rebuilt here from
its documented fields:

* a batch is a msgpack array `[ts, events, data_parallel_rank]` (the rank
  left out when unset); `ts` is the publisher's wall-clock time in seconds;
* each event is a msgpack map tagged by a `type` field: `BlockStored`,
  `BlockRemoved` or `AllBlocksCleared`;
* BlockStored: `block_hashes`, `parent_block_hash` (nil before a chain's
  first block in vLLM; ours is the chain's root key, see below),
  `token_ids` (the stored blocks' tokens, one block after the other),
  `block_size`, `lora_id`, `medium`, `lora_name`, and the group fields vLLM
  has for hybrid models: `group_idx`, `kv_cache_spec_kind` (vLLM's names:
  full_attention, sliding_window, chunked_local_attention, mamba) and
  `kv_cache_spec_sliding_window`;
* BlockRemoved: `block_hashes`, `medium`, `group_idx`.

Block hashes are the manager's keys as they are: 32-byte SHA-256 digests
(msgpack bin) with the default hash, 64-bit ints with
`hash_function="builtin"`; `hybridkv.core.hashing.BlockHasher` computes them
from token ids, torch-free. A chain's first block names its parent: the
chain's root, which holds the cache salt, so the parent is never nil here.

One extension, a map field vLLM's decoder ignores (its events are maps
and unknown fields are skipped): `hybridkv_chunk_size`, the chunk of a
chunked-local group, which vLLM's event has no field for. Everything else
the hit rule needs is in vLLM's fields; the layout as a whole (group
structure, Mamba states) is served by `GET /kv_events` (docs/server.md).
"""

from __future__ import annotations

import time

import msgspec

from ..core.events import AllBlocksCleared, BlockRemoved, BlockStored
from ..core.layout import KVCacheLayout
from ..core.specs import RECURRENT_KINDS

# Our group kinds and vLLM's KVCacheSpecKind values, both ways. vLLM names
# every recurrent state "mamba" (whatever the mixer), and so does the wire.
VLLM_KIND = {"full": "full_attention", "sliding_window": "sliding_window",
             "chunked_local": "chunked_local_attention", **dict.fromkeys(RECURRENT_KINDS, "mamba")}
OUR_KIND = {"full_attention": "full", "sliding_window": "sliding_window",
            "chunked_local_attention": "chunked_local", "mamba": "mamba"}

BlockHash = bytes | int


class WireBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM always sends these three, nil when unused
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    hybridkv_chunk_size: int | None = None  # the extension: a chunked-local group's chunk


class WireBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class WireAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


class WireFormat:
    """Encodes one engine's events (core/events.py) into batches and
    decodes batches back, for one layout (the group fields come from it)."""

    def __init__(self, layout: KVCacheLayout, medium: str | None = "GPU", data_parallel_rank: int | None = None):
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self._group_fields = [dict(kv_cache_spec_kind=VLLM_KIND[g.kind],
                                   kv_cache_spec_sliding_window=getattr(g.spec, "sliding_window", None),
                                   hybridkv_chunk_size=getattr(g.spec, "chunk_size", None))
                              for g in layout.groups]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WireBatch)

    def encode(self, events: list, ts: float | None = None) -> bytes:
        wire = []
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                wire.append(WireBlockStored(list(event.block_hashes), event.parent_block_hash,
                                            list(event.token_ids or ()), event.block_size, None, self.medium, None,
                                            group_idx=event.group_idx, **self._group_fields[event.group_idx]))
            elif kind is BlockRemoved:
                wire.append(WireBlockRemoved(list(event.block_hashes), self.medium, group_idx=event.group_idx))
            elif kind is AllBlocksCleared:
                wire.append(WireAllBlocksCleared())
            else:
                raise ValueError(f"not a KV event: {event!r}")
        return self._encoder.encode(WireBatch(time.time() if ts is None else ts, wire, self.data_parallel_rank))

    def decode(self, payload: bytes) -> tuple[float, list]:
        """A batch's time and its events as core events. A vLLM batch
        without group fields reads as group 0, full attention."""
        batch = self._decoder.decode(payload)
        out = []
        for event in batch.events:
            if type(event) is WireBlockStored:
                group = event.group_idx or 0
                out.append(BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                                       group, OUR_KIND.get(event.kv_cache_spec_kind, "full")))
            elif type(event) is WireBlockRemoved:
                out.append(BlockRemoved(event.block_hashes, event.group_idx or 0))
            else:
                out.append(AllBlocksCleared())
        return batch.ts, out
