"""The connector's scheduler side: which hits the tiers serve, which blocks
they store, and the KV events that publish what they hold.

It keeps a mirror of the tiers' index (per group: key -> "host" or
"disk"): what the disk tier's directory held at start, then every change
the workers report. With vLLM's synchronous scheduling (its CPU build's
default) a report arrives before the next step is scheduled, so the mirror
is exact when a hit is planned; a load whose block the tiers lost anyway
(a damaged file) fails on the worker, and vLLM recomputes the request.

Hits (`match`): hybridkv's rule over the mirror, per group kind
(groups.py). The blocks vLLM allocates for them are loaded asynchronously:
the request waits one engine step (the worker copies after that step's
forward pass), and is scheduled with its hit the step after.

Stores, only of what a future hit can use, which vLLM decides by caching:
* what a finished request leaves: its full, computed blocks that the tiers
  lack (a sliding-window group holds only its last window by then). Their
  free is delayed until the worker has copied them.
* what the pool is about to evict: the first `lookahead` blocks of vLLM's
  free queue that are cached (vLLM caches a sliding-window block only where
  it can end a hit) and that the tiers lack are pinned, copied in the
  step's plan, and put back at the head of the queue once the worker
  reports the step done, still first in line for eviction.
"""

from __future__ import annotations

from collections import deque

from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...tiers import has_block
from .groups import TierGroups
from ...core.tiers import BlockLoad, BlockStore
from .plan import TierPlan, TierReport

MEDIUM = {"host": MEDIUM_CPU, "disk": MEDIUM_STORAGE}
SOURCE = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class TierScheduler:
    def __init__(self, groups: TierGroups, held: list[dict], lookahead: int, events: bool,
                 shared: tuple[str, list[bytes]] | None = None, producer: bool = False):
        self.groups = groups
        # vLLM's kv_role "kv_producer": a prompt's blocks are stored in the
        # step that computes them (after its forward pass, before its outputs
        # go back), so a consumer asking as soon as the producer answered
        # finds them; a request's block ids, as the steps give them out.
        self.producer = producer
        self.prefilling: dict[str, tuple[object, list[list[int]]]] = {}
        self.held = held  # per group: key -> "host" | "disk" (the workers' tiers, mirrored)
        # vLLM's kv_role "kv_consumer": (directory, each rank's identity) where
        # a producer writes; a request's blocks found there join `held`.
        self.shared = shared
        self.learned: set[str] = set()  # requests whose blocks were looked for there
        self.lookahead = lookahead
        self.events: list | None = [] if events else None
        if self.events is not None:
            self._publish_held()
        self.block_pool = None
        self.step = 0
        self.plan = TierPlan(self.step)
        self.lookups: dict[str, tuple[int, int]] = {}  # request -> (local tokens, hit tokens) of its last match
        self.loading: dict[str, dict] = {}  # request -> {CacheHitSource: tokens} of its load in flight
        self.pending: dict[tuple[int, bytes], int] = {}  # stores sent, not yet reported -> their step
        self.pins: deque[tuple[int, list]] = deque()  # (step, pinned pool blocks) until the workers copied them
        self.stats = {"hit_tokens": 0, "loaded_blocks": [0] * len(held), "stored_blocks": [0] * len(held),
                      "stores_finished": 0, "stores_evicting": 0, "stores_prefilled": 0,
                      "failed_loads": 0}

    # -- hits ---------------------------------------------------------------
    def match(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's get_num_new_matched_tokens: the tokens past the local hit
        that the tiers serve (loaded asynchronously), and no side effect
        but remembering the answer for the allocation that follows."""
        self.lookups.pop(request.request_id, None)
        if self.producer:
            self.prefilling.setdefault(request.request_id, (request, []))
        bs = self.groups.block_size
        # Whole blocks, and at least one token left to compute (its logits).
        keys = self.groups.keys(request.block_hashes, (request.num_tokens - 1) // bs)
        if self.shared is not None and request.request_id not in self.learned:
            self._learn(keys)
            self.learned.add(request.request_id)
        if not any(self.held):
            return 0, False
        local = num_computed_tokens // bs
        hit = self.groups.hit(keys, local, self.held)
        if hit <= local:
            return 0, False
        self.lookups[request.request_id] = (num_computed_tokens, hit * bs)
        return hit * bs - num_computed_tokens, True

    def _learn(self, keys: list) -> None:
        """The blocks of `keys` that a producer has written to the shared
        directory, on every rank (by name: nothing is read), join `held`."""
        directory, identities = self.shared
        for g, held in enumerate(self.held):
            for key in keys:
                if key not in held and all(has_block(directory, i, g, key) for i in identities):
                    self._moved(g, key, "disk")

    def allocated(self, request, blocks, num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: plan the loads of the hit that
        `match` gave into the blocks vLLM allocated for it."""
        lookup = self.lookups.pop(request.request_id, None)
        if num_external_tokens == 0 or lookup is None:
            return
        _, hit = lookup
        bs = self.groups.block_size
        start = (hit - num_external_tokens) // bs  # the local hit, as vLLM took it
        keys = self.groups.keys(request.block_hashes, hit // bs)
        items = []
        sources: dict = {}
        for g, ids in enumerate(blocks.get_block_ids()):
            held = self.held[g]
            for j in range(max(start, self.groups.first_needed(g, hit // bs)), hit // bs):
                if ids[j]:  # vLLM allocates a null block where the group reads nothing
                    tier = held.get(keys[j])
                    # (None: the mirror changed since match; the worker fails
                    # the load and vLLM recomputes.)
                    items.append(BlockLoad(request.request_id, g, keys[j], (ids[j],), tier or ""))
                    self.stats["loaded_blocks"][g] += 1
                    if tier is not None:
                        sources[j] = "disk" if tier == "disk" or sources.get(j) == "disk" else "host"
        self.plan.loads.extend(items)
        self.plan.loading.append(request.request_id)
        # Where each served token came from: a position is from disk if any
        # group's block for it is (the slowest tier it waited for).
        by_source: dict = {}
        for j in range(start, hit // bs):
            source = SOURCE[sources.get(j, "host")]
            by_source[source] = by_source.get(source, 0) + bs
        self.loading[request.request_id] = by_source
        self.stats["hit_tokens"] += num_external_tokens

    def hit_sources(self, request, num_external_tokens: int) -> dict:
        """vLLM's get_external_cache_hit_sources."""
        if not num_external_tokens:
            return {}
        sources = self.loading.get(request.request_id)
        if not sources or sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return dict(sources)

    # -- stores -------------------------------------------------------------
    def finished(self, request, block_ids: tuple) -> bool:
        """vLLM's request_finished_all_groups: store the request's blocks
        that the tiers lack; True (free them later) if it holds any of them.
        Where a group released a block (a window that moved on), the pool's
        cached copy is stored if vLLM kept one, which it does where a later
        hit can end (the window at the prompt's end): pinned until copied."""
        self.learned.discard(request.request_id)
        self.prefilling.pop(request.request_id, None)
        if self.loading.pop(request.request_id, None) is not None:
            return False  # finished before its load was done: nothing of it is computed yet
        bs = self.groups.block_size
        keys = self.groups.keys(request.block_hashes, request.num_computed_tokens // bs)  # computed, whole blocks
        held_stores, pinned = [], []
        for g, ids in enumerate(block_ids):
            for j, key in enumerate(keys):
                block_id = ids[j] if j < len(ids) else 0
                if block_id:
                    held_stores.extend(self._store(g, key, block_id))
                elif key not in self.held[g] and self.block_pool is not None:
                    cached = self.block_pool.get_cached_block(key, [g])
                    stores = self._store(g, key, cached[0].block_id) if cached else []
                    if stores:
                        pinned.append(cached[0])
                        self.plan.stores.extend(stores)
        self._pin(pinned)
        if not held_stores:
            return False
        self.plan.stores.extend(held_stores)
        self.plan.released.append(request.request_id)
        return True

    def _store(self, group: int, key: bytes, block_id: int, reason: str = "finished") -> list:
        item = (group, key)
        if key in self.held[group] or item in self.pending:
            return []
        self.pending[item] = self.step
        self.stats["stored_blocks"][group] += 1
        self.stats["stores_" + reason] += 1
        return [BlockStore(group, key, (block_id,))]

    def _pin(self, blocks: list) -> None:
        """Keep `blocks` out of the free queue until the workers copied them."""
        if blocks:
            self.block_pool.touch(blocks)
            self.pins.append((self.step, blocks))

    def _pin_evictable(self) -> None:
        """Pin the cached blocks the pool will evict next (the first
        `lookahead` of the free queue) that the tiers lack, and plan their
        stores."""
        if self.block_pool is None or not self.lookahead:
            return
        bs = self.groups.block_size
        found = []
        for n, block in enumerate(self.block_pool.free_block_queue.iter_blocks_after(None)):
            if n >= self.lookahead:
                break
            tag = block.block_hash
            if tag is None or (block.block_hash_num_tokens or 0) % bs:
                continue  # not cached, or a partial block
            group, key = get_group_id(tag), get_block_hash(tag)
            if group < len(self.held):
                stores = self._store(group, key, block.block_id, reason="evicting")
                if stores:
                    found.append(block)
                    self.plan.stores.extend(stores)
        self._pin(found)

    def _unpin(self, step: int) -> None:
        """The workers copied the blocks pinned up to `step`: back to the
        head of the free queue, in the order they left it."""
        while self.pins and self.pins[0][0] <= step:
            _, blocks = self.pins.popleft()
            free = []
            for block in blocks:
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    free.append(block)
            self.block_pool.free_block_queue.prepend_n(free)

    # -- the step -----------------------------------------------------------
    def build_plan(self, scheduler_output=None) -> TierPlan:
        """vLLM's build_connector_meta: this step's plan, then a new one."""
        if self.producer and scheduler_output is not None:
            self._store_prefills(scheduler_output)
        self._pin_evictable()
        plan = self.plan
        self.step += 1
        self.plan = TierPlan(self.step)
        return plan

    def _store_prefills(self, out) -> None:
        """A producer's stores of the prompt blocks this step completes: the
        ones a hit on the whole prompt reads (a sliding-window group's last
        window), from the block ids the step gives each request (vLLM's
        scheduler output: a new request's, then each step's new ones)."""
        whole = set()  # requests whose whole block table this step gives (null blocks where a window moved on)
        for new in out.scheduled_new_reqs:
            if new.req_id in self.prefilling:
                self.prefilling[new.req_id][1][:] = [list(ids) for ids in new.block_ids]
                whole.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in self.prefilling and ids is not None:
                tracked = self.prefilling[rid][1]
                if rid in cached.resumed_req_ids or not tracked:
                    tracked[:] = [list(g) for g in ids]
                    whole.add(rid)
                else:
                    for mine, more in zip(tracked, ids):
                        mine.extend(more)
        bs = self.groups.block_size
        for rid, count in out.num_scheduled_tokens.items():
            if rid not in self.prefilling:
                continue
            request, block_ids = self.prefilling[rid]
            prompt = request.num_prompt_tokens
            before, after = request.num_computed_tokens, min(prompt, request.num_computed_tokens + count)
            end = (prompt - 1) // bs  # the blocks a hit on the prompt reads (its last token is computed)
            keys = self.groups.keys(request.block_hashes, min(end, after // bs))
            for g, ids in enumerate(block_ids):
                # The blocks this step computes, and on a whole table the local hit's too: an id
                # tracked from an earlier step may have been freed since (a window moved on).
                first = self.groups.first_needed(g, end)
                for j in range(first if rid in whole else max(first, before // bs), len(keys)):
                    if j < len(ids) and ids[j]:
                        self.plan.stores.extend(self._store(g, keys[j], ids[j], reason="prefilled"))
            if after >= prompt:
                del self.prefilling[rid]

    def reported(self, report: TierReport | None, finished_recving, failed_recving) -> None:
        """vLLM's update_connector_output: the workers' changes to the tiers."""
        for request_id in finished_recving or ():
            self.loading.pop(request_id, None)
        self.stats["failed_loads"] += len(failed_recving or ())
        if report is None:
            return
        for group, key, tier in report.moves:
            self._moved(group, key, tier)
        self._unpin(report.step)
        for item, step in list(self.pending.items()):
            if step <= report.step:
                del self.pending[item]

    def _moved(self, group: int, key: bytes, tier: str | None) -> None:
        held = self.held[group]
        before = held.get(key)
        if before == tier:
            return
        if tier is None:
            del held[key]
        else:
            held[key] = tier
        if self.events is not None:
            kind = self.groups.kinds[group]
            if before is not None:
                self.events.append(BlockRemoved(block_hashes=[key], medium=MEDIUM[before], group_idx=group))
            if tier is not None:
                self.events.append(BlockStored(block_hashes=[key], parent_block_hash=None, token_ids=[],
                                               block_size=self.groups.block_size, lora_id=None,
                                               medium=MEDIUM[tier], lora_name=None, group_idx=group,
                                               kv_cache_spec_kind=kind))

    def _publish_held(self) -> None:
        """What the tiers hold at start (the disk tier's files), one event
        per group and tier."""
        for g, held in enumerate(self.held):
            for tier in ("host", "disk"):
                keys = [key for key, where in held.items() if where == tier]
                if keys:
                    self.events.append(BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=[],
                                                   block_size=self.groups.block_size, lora_id=None,
                                                   medium=MEDIUM[tier], lora_name=None, group_idx=g,
                                                   kv_cache_spec_kind=self.groups.kinds[g]))

    def take_events(self) -> list:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def reset(self) -> bool:
        """vLLM's reset_cache (the weights changed): the tiers forget
        everything, starting with the next step's plan."""
        self.plan.clear = True
        self.plan.loads.clear()  # (none can be in flight: vLLM resets with no request running)
        self.plan.loading.clear()
        if self.events is not None:
            for g, held in enumerate(self.held):
                for tier in ("host", "disk"):
                    keys = [key for key, where in held.items() if where == tier]
                    if keys:
                        self.events.append(BlockRemoved(block_hashes=keys, medium=MEDIUM[tier], group_idx=g))
        for held in self.held:
            held.clear()
        self.pending.clear()
        return True

