"""`HybridkvConnector`: vLLM's KV connector API (v1, with `SupportsHMA`, so
vLLM keeps its hybrid KV cache manager and hands over block ids per group),
each call handed to the side that serves it: `TierScheduler` in the
scheduler's process, `TierWorker` in each worker's.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                                KVConnectorTransferResults, SupportsHMA)
from vllm.logger import init_logger

from .groups import TierGroups, identity
from .options import TierOptions
from .scheduler import TierScheduler
from .worker import TierWorker

logger = init_logger(__name__)
TRUSTED_HASHES = ("sha256", "sha256_cbor")


class HybridkvConnector(KVConnectorBase_V1, SupportsHMA):
    """Host-memory and disk prefix tiers below vLLM's KV pool, per KV cache
    group, with hybridkv's hit rule (docs/integrations.md)."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store that never happens is a later miss

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        options = TierOptions.from_extra_config(transfer.kv_connector_extra_config)
        cache = vllm_config.cache_config
        if not cache.enable_prefix_caching:
            raise ValueError("hybridkv's connector serves prefix hits: start vLLM with prefix caching on")
        if str(cache.prefix_caching_hash_algo) not in TRUSTED_HASHES:
            raise ValueError(f"hybridkv's connector needs a collision-resistant block hash (the tiers keep no "
                             f"token ids to check): --prefix-caching-hash-algo sha256, not "
                             f"{cache.prefix_caching_hash_algo}")
        if transfer.kv_load_failure_policy != "recompute":
            # A block the tiers lose is a miss, never an error for the request.
            logger.warning("hybridkv's connector sets kv_load_failure_policy to 'recompute' (was %r): a block "
                           "the tiers lose or find damaged is computed again", transfer.kv_load_failure_policy)
            transfer.kv_load_failure_policy = "recompute"
        if transfer.kv_role in ("kv_producer", "kv_consumer") and not options.disk_dir:
            raise ValueError(f"hybridkv's connector as {transfer.kv_role} needs kv_connector_extra_config's "
                             f"'disk_dir': the directory the producer writes and the consumer reads")
        self.groups = TierGroups.from_vllm(kv_cache_config)
        self.options = options
        self._scheduler: TierScheduler | None = None
        self._worker: TierWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._make_scheduler(vllm_config, options)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            self._worker = TierWorker(self.groups, options, identity(vllm_config, self.groups, rank),
                                      producer=transfer.kv_role == "kv_producer")

    def _make_scheduler(self, vllm_config, options: TierOptions) -> TierScheduler:
        from ...tiers import list_blocks

        groups = self.groups
        held: list[dict] = [{} for _ in groups.layout.groups]
        if options.disk_dir:
            # What an earlier run left on disk, as every worker's directory
            # has it (file names only; the workers check contents on load).
            found = None
            for rank in range(vllm_config.parallel_config.tensor_parallel_size):
                files = set(list_blocks(options.disk_dir, identity(vllm_config, groups, rank)))
                found = files if found is None else found & files
            for group, key in found or ():
                if group < len(held):
                    held[group][key] = "disk"
        lookahead = options.lookahead_blocks
        if lookahead is None:  # what one step can allocate
            sched = vllm_config.scheduler_config
            lookahead = (sched.max_num_batched_tokens // groups.block_size + sched.max_num_seqs) * len(held)
        events = vllm_config.kv_events_config is not None and vllm_config.kv_events_config.enable_kv_cache_events
        shared = None
        if vllm_config.kv_transfer_config.kv_role == "kv_consumer":  # learns what a producer writes meanwhile
            shared = (options.disk_dir, [identity(vllm_config, groups, rank)
                                         for rank in range(vllm_config.parallel_config.tensor_parallel_size)])
        return TierScheduler(groups, held, lookahead, events, shared,
                             producer=vllm_config.kv_transfer_config.kv_role == "kv_producer")

    # -- scheduler side -------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        self._scheduler.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.allocated(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        return self._scheduler.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._scheduler.build_plan(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.reported(connector_output.kv_connector_worker_meta, connector_output.finished_recving,
                                 connector_output.failed_recving)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, (block_ids,)), None

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self._scheduler.finished(request, block_ids), None

    def take_events(self):
        return self._scheduler.take_events()

    def reset_cache(self) -> bool:
        return self._scheduler.reset()

    # -- worker side ----------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.begin(self._get_connector_metadata())
        self._worker.load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are asynchronous: done before the request's first forward pass

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        pass  # stores copy whole blocks from the pool, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker.save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker.results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received, _ = self._worker.results()
        return sent or None, received or None

    def build_connector_worker_meta(self):
        return self._worker.report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.flush()
