"""Prometheus metrics of the server (`GET /metrics`).

Engine counters live on the engine thread; `/metrics` fetches one snapshot
of them through the engine loop and this collector turns it into metric
families at scrape time (nothing is copied per step). The time-to-first-token
histogram is observed by the engine thread as first tokens appear.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("hybridkv_time_to_first_token_seconds",
                              "Seconds from a request's arrival at the engine to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self._snapshots: dict = {}  # replica label (None: one engine, no label) -> engine snapshot
        self.registry.register(self)

    def render(self, snapshot: dict) -> bytes:
        """The exposition text for one engine snapshot (EngineLoop.snapshot)."""
        self._snapshots = {None: snapshot} if snapshot else {}
        return generate_latest(self.registry)

    def render_replicas(self, snapshots: dict) -> bytes:
        """The exposition text for several engines, `{replica id: snapshot}`:
        every engine metric once per replica, with a `replica` label."""
        self._snapshots = {str(r): s for r, s in snapshots.items() if s}
        return generate_latest(self.registry)

    def collect(self):
        if list(self._snapshots) == [None]:
            yield from self._families(self._snapshots[None])
            return
        merged: dict = {}  # family name -> the family, samples of every replica
        for replica, snapshot in self._snapshots.items():
            for family in self._families(snapshot):
                into = merged.setdefault(family.name, family)
                labeled = [sample._replace(labels={"replica": replica, **sample.labels})
                           for sample in family.samples]
                if into is family:
                    family.samples = labeled
                else:
                    into.samples.extend(labeled)
        yield from merged.values()

    def _families(self, s: dict):

        def gauge(name, doc, value):
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("hybridkv_num_requests_running", "Requests being computed", s["running"])
        yield gauge("hybridkv_num_requests_waiting", "Requests waiting for admission", s["waiting"])
        yield gauge("hybridkv_kv_cache_usage_ratio", "Fraction of the KV pool's pages in use", s["kv_usage"])
        yield gauge("hybridkv_kv_cache_free_pages", "Free KV pages (cached but unreferenced pages count as free)",
                    s["kv_free_pages"])
        yield gauge("hybridkv_kv_cache_total_pages", "KV pages in the pool, the null page excluded",
                    s["kv_total_pages"])
        pages = GaugeMetricFamily("hybridkv_kv_cache_group_pages", "KV pages held by live requests, per group",
                                  labels=["group", "kind"])
        usage = GaugeMetricFamily("hybridkv_kv_cache_group_usage_ratio",
                                  "Fraction of the shared KV pool held by each group", labels=["group", "kind"])
        for i, (kind, held) in enumerate(zip(s["group_kinds"], s["kv_pages_in_use_by_group"])):
            pages.add_metric([str(i), kind], held)
            usage.add_metric([str(i), kind], held / max(1, s["kv_total_pages"]))
        yield pages
        yield usage
        capped = CounterMetricFamily("hybridkv_prefix_cache_capped_tokens",
                                     "Prompt tokens the joint prefix hit would have had on top if this group "
                                     "had served more (kv.explain_hit), summed over admissions",
                                     labels=["group", "kind"])
        evicted = CounterMetricFamily("hybridkv_prefix_cache_evictions",
                                      "Cache keys dropped, per group and reason: lru (a free cached block reused), "
                                      "probation (a prompt-end Mamba checkpoint), superseded, reset, lost (a tier load that failed)",
                                      labels=["group", "kind", "reason"])
        for i, kind in enumerate(s["group_kinds"]):
            capped.add_metric([str(i), kind], s["capped_tokens"][i])
            for reason, counts in s["evictions_by_reason"].items():
                evicted.add_metric([str(i), kind, reason], counts[i])
        yield capped
        yield evicted
        yield gauge("hybridkv_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens "
                    "looked up, since start", s["prefix_hit_rate"])
        yield counter("hybridkv_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                      s["prefix_queried_tokens"])
        yield counter("hybridkv_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                      s["prefix_hit_tokens"])
        yield counter("hybridkv_preemptions", "Sequences preempted (recompute) for lack of KV pages",
                      s["preemptions"])
        yield counter("hybridkv_generation_tokens", "Tokens generated", s["generated_tokens"])
        yield counter("hybridkv_prompt_tokens", "Prompt tokens admitted", s["prompt_tokens"])
        yield counter("hybridkv_engine_steps", "Engine steps run", s["steps"])
        routes = CounterMetricFamily("hybridkv_engine_step_routes", "Engine steps per route: the backend and the "
                                     "way it ran the step (e.g. cpu:decoder-layers)", labels=["route"])
        for route, n in sorted(s["backend"]["routes"].items()):
            routes.add_metric([route], n)
        yield routes
        yield counter("hybridkv_spec_decode_draft_tokens", "Draft tokens verified (speculative decoding)",
                      s["spec_draft_tokens"])
        yield counter("hybridkv_spec_decode_accepted_tokens", "Draft tokens the model agreed with (speculative "
                      "decoding)", s["spec_accepted_tokens"])
        yield from self._tiers(s)
        yield counter("hybridkv_requests_aborted", "Requests aborted because their client went away",
                      s["aborted"])
        yield counter("hybridkv_requests_rejected", "Requests refused with 503: the waiting queue was full",
                      s["rejected"])

    @staticmethod
    def _tiers(s: dict):
        """The tiers below the pool (tiers/store.py), when the engine has any."""
        if "kv_tier_stores" not in s:
            return
        loads = CounterMetricFamily("hybridkv_kv_tier_loaded_blocks",
                                    "Hit blocks loaded into the pool from a tier, per tier and group",
                                    labels=["tier", "group", "kind"])
        for tier, per_group in s["kv_tier_loads_by_group"].items():
            for i, kind in enumerate(s["group_kinds"]):
                loads.add_metric([tier, str(i), kind], per_group[i])
        yield loads
        stored = CounterMetricFamily("hybridkv_kv_tier_group_store_bytes",
                                     "Bytes copied from the pool into the tiers, per group", labels=["group", "kind"])
        for i, kind in enumerate(s["group_kinds"]):
            stored.add_metric([str(i), kind], s["kv_tier_store_bytes_by_group"][i])
        yield stored
        for name, doc in (("stores", "Blocks the pool evicted that the tiers kept"),
                          ("store_bytes", "Bytes copied from the pool into the tiers"),
                          ("loads", "Blocks read back from the tiers"),
                          ("load_bytes", "Bytes read back from the tiers"),
                          ("evictions", "Blocks no tier holds any more (budgets, damaged files)"),
                          ("load_seconds", "Seconds spent reading tier hits and copying them into the pool")):
            yield CounterMetricFamily(f"hybridkv_kv_tier_{name}", doc, value=s[f"kv_tier_{name}"])
        for tier, limit in (("host", "capacity_bytes"), ("disk", "budget_bytes")):
            if f"kv_tier_{tier}_blocks" in s:
                yield GaugeMetricFamily(f"hybridkv_kv_tier_{tier}_blocks", f"Blocks held in the {tier} tier",
                                        value=s[f"kv_tier_{tier}_blocks"])
                yield GaugeMetricFamily(f"hybridkv_kv_tier_{tier}_bytes", f"Bytes used in the {tier} tier",
                                        value=s[f"kv_tier_{tier}_bytes_used"])
                yield GaugeMetricFamily(f"hybridkv_kv_tier_{tier}_{limit}", f"Bytes the {tier} tier may use",
                                        value=s[f"kv_tier_{tier}_{limit}"])
        if "kv_tier_disk_blocks" in s:
            yield GaugeMetricFamily("hybridkv_kv_tier_disk_writing", "1 while the disk tier stores blocks, 0 while "
                                    "it pauses after a write error", value=int(s["kv_tier_disk_writable"]))
            yield CounterMetricFamily("hybridkv_kv_tier_disk_writes", "Blocks the disk tier wrote",
                                      value=s["kv_tier_disk_writes"])
            yield CounterMetricFamily("hybridkv_kv_tier_disk_write_errors", "Disk tier writes that failed (a full "
                                      "disk, a read-only or vanished directory, an I/O error)",
                                      value=s["kv_tier_disk_write_errors"])
