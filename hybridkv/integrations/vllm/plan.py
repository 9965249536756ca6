"""What the connector's two sides say to each other, and nothing else: the
scheduler side sends one plan per step, every worker sends one report back.

A plan's loads run first (tier content into blocks vLLM just allocated to
a waiting request), then its stores (pool blocks into the tiers: blocks a
finished request still holds, blocks pinned on their way out of the free
queue). A report lists every change of what a worker's tiers hold, in
order, so the scheduler side keeps an exact mirror of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...core.tiers import BlockLoad, BlockStore


@dataclass
class TierPlan(KVConnectorMetadata):
    """One step's copies, in the entries hybridkv's own engine plans with
    (core/tiers.py), a block's "pages" being its vLLM block id. A request's
    loads are all or nothing."""
    step: int
    loads: list[BlockLoad] = field(default_factory=list)  # in position order, per request
    loading: list[str] = field(default_factory=list)  # the requests whose loads these are (each reported back)
    stores: list[BlockStore] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # finished requests whose blocks wait for these stores
    clear: bool = False  # forget everything first (vLLM's reset of the connector cache)

    def has_work(self) -> bool:
        return bool(self.loading or self.stores or self.released or self.clear)


@dataclass
class TierReport(KVConnectorWorkerMetadata):
    step: int  # the plan the worker has carried out
    moves: list[tuple[int, bytes, str | None]] = field(default_factory=list)  # (group, key, "host" | "disk" | None)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel workers carry out the same plan on their shards: a
        # step is done when every worker did it, and a key one worker lost is
        # lost (its moves come last, so a removal anywhere wins).
        assert isinstance(other, TierReport)
        moves = self.moves + other.moves
        gone = [m for m in moves if m[2] is None]
        return TierReport(min(self.step, other.step), moves + gone)
