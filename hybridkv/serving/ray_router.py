"""A Ray Serve request router that sends each request to the replica with
the longest hybrid prefix hit, balanced against queue length.

Ray Serve runs one router per deployment in each process that holds a
handle to it (here the OpenAI ingress replicas). Each router keeps its own
PrefixIndex, fed by the replicas' KV event reports that arrive with their
routing stats (kv_events/feed.py says how, and how stale), adds the
blocks of the prompts it sent in the last few report periods
(RecentRoutes: what the reports will say once they catch up), and ranks
the candidates by RoutingRule's cost (core/routing.py): the prompt tokens
a replica would still have to compute, less a credit for the leading
blocks it holds past its hit, plus a price per request queued there. Queue lengths are Ray's own (the router's cache of each replica's
ongoing requests, raised as requests are sent). The ranks are single
replicas in cost order, so if the cheapest one refuses (its queue is at
max_ongoing_requests) the next is tried, as Ray does with any rank.

The router reads the request's token ids from the call's keyword arguments
(`token_ids`, `cache_salt`): the ingress tokenizes before it calls. A call
without them (a replica's `describe`) is routed by queue length alone.
"""

from __future__ import annotations

import importlib
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..core.routing import RoutingRule
from ..kv_events.feed import IndexFeed, RecentRoutes

# (application, deployment) -> {replica id: its engine counters}, as the routers of this
# process last saw them: the ingress's /metrics reads it (the ingress and its
# handle's router share the process).
REPLICA_STATS: dict[tuple[str, str], dict[str, dict]] = {}
# (application, deployment) -> the router of this process: the ingress asks
# it how much of a prompt the deployment's replicas hold (`best_hit`).
ROUTERS: dict[tuple[str, str], "HybridPrefixRouter"] = {}


def replica_stats() -> dict:
    """This process's REPLICA_STATS. Ray ships the router class and the
    ingress class to the workers by value, each with its own copy of the
    module globals it uses; both find the one dict through the imported
    module."""
    return importlib.import_module(__name__).REPLICA_STATS


def router_of(app_name: str, deployment: str) -> "HybridPrefixRouter | None":
    """This process's router of a deployment (ROUTERS, found as
    REPLICA_STATS is), or None before its first call."""
    return importlib.import_module(__name__).ROUTERS.get((app_name, deployment))


class HybridPrefixRouter(RequestRouter):
    # Not FIFOMixin: it hands the replica chosen for one request to whichever
    # request is first in line, and the choice here is for this request's
    # prompt. The base class gives each request the replica chosen for it.

    def initialize_state(self, queued_request_tokens: int = 256, recent_horizon_s: float = 5.0, **_ignored):
        self.rule = RoutingRule(queued_request_tokens)
        self.feed = IndexFeed()
        self.recent = RecentRoutes(recent_horizon_s)
        self.num_routed = 0
        self.num_routed_to_hit = 0
        importlib.import_module(__name__).ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.feed.forget(replica_id.unique_id)
        self._take_reports()

    def _take_reports(self) -> None:
        """Apply the reports that came with the latest replica info (a
        no-op for those already taken)."""
        seen = {}
        for replica in self._replicas.values():
            stats = replica.routing_stats or {}
            self.feed.offer(replica.replica_id.unique_id, stats.get("kv_events"))
            if "engine" in stats:
                seen[replica.replica_id.unique_id] = stats["engine"]
        replica_stats()[(self._deployment_id.app_name, self._deployment_id.name)] = seen

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._take_reports()
        kwargs = pending_request.kwargs if pending_request is not None else {}
        token_ids = kwargs.get("token_ids")
        queues = {}
        for r in candidate_replicas:
            queue = self.replica_queue_len_cache.get(r.replica_id)
            queues[r.replica_id.unique_id] = queue or 0
        names = [r.replica_id.unique_id for r in candidate_replicas]
        keys = self._keys(pending_request)  # hashed once, for the hits and the held runs
        hits = self._hits(names, token_ids, kwargs.get("cache_salt"), keys)
        held = None
        if keys:
            # The leading blocks a replica holds past its hit: where a
            # family's next computation leaves the checkpoint its later
            # requests hit (RoutingRule's affinity).
            held = self.feed.index.held_tokens(keys)
            held = {n: max(held.get(n, 0), hits.get(n, 0)) for n in names}
        costs = self.rule.costs(len(token_ids or ()), names, hits, queues, held)
        first = self.rule.choose(len(token_ids or ()), names, hits, queues, held)
        by_name = dict(zip(names, candidate_replicas))
        order = [first] + sorted((n for n in names if n != first), key=lambda n: (costs[n], queues[n]))
        if token_ids:
            self.num_routed += 1
            self.num_routed_to_hit += hits.get(first, 0) > 0
        return [[by_name[n]] for n in order]

    def _hits(self, names: list[str], token_ids, cache_salt, keys: list) -> dict[str, int]:
        """Each replica's hit on the prompt in tokens: what its reports
        say, or what the prompts routed to it lately will leave there."""
        hits = self.feed.hits(token_ids, cache_salt, keys) if token_ids else {}
        if keys:
            reports = {n: self.feed.reports.get(n, 0) for n in names}
            recent = self.recent.hits(reports, keys, self.feed.index.block_size, time.monotonic())
            hits = {n: max(hits.get(n, 0), recent.get(n, 0)) for n in names}
        return hits

    def best_hit(self, token_ids: list[int], cache_salt=None) -> int:
        """The longest hit on the prompt any of the replicas holds, in tokens."""
        self._take_reports()
        if not token_ids or self.feed.index is None:
            return 0
        names = [r.replica_id.unique_id for r in self._replicas.values()]
        keys = self.feed.index.block_keys(token_ids, cache_salt)[0]
        return max(self._hits(names, token_ids, cache_salt, keys).values(), default=0)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        keys = self._keys(pending_request)
        if keys:
            replica = replica_id.unique_id
            self.recent.add(replica, keys, time.monotonic(), self.feed.reports.get(replica, 0))

    def _keys(self, pending_request: PendingRequest | None) -> list:
        """The request's block keys, once the index knows the layout."""
        kwargs = pending_request.kwargs if pending_request is not None else {}
        if not kwargs.get("token_ids") or self.feed.index is None:
            return []
        return self.feed.index.block_keys(kwargs["token_ids"], kwargs.get("cache_salt"))[0]
