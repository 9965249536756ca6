"""docs/benchmarks.md's tables (and those of the README and of
docs/integrations.md, kernels.md and server.md), written from the result
files they report.

In a page a table is a marker, a caption naming its result file, date,
machine and command (left out where the table above came from the same
files), and the table, all written here:

    <!-- table memory -->
    `memory.json`, 2026-11-27, Intel Xeon (AMX), 2 cores, 24 GiB, load average 0.9 to 1.1, commit 0123abcd4567:
    `python -m benchmarks.memory`

    | model | groups | waste | ...
    <!-- end table -->

The text around the markers is the page's own. To add a table: an entry in
TABLES (its result file, which rows, a header and a cell per column), and
its marker in a page (each table in one page at least); then

    python -m benchmarks.render           # rewrite the tables in the pages
    python -m benchmarks.render --check   # exit 1 where a page and the results disagree (the tests check the same)

docs/benchmarks.md holds no table but these; the other pages' text is their own.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from benchmarks import harness

PAGE = os.path.join(harness.ROOT, "docs", "benchmarks.md")
PAGES = (PAGE, os.path.join(harness.ROOT, "README.md"), os.path.join(harness.ROOT, "docs", "integrations.md"),
         os.path.join(harness.ROOT, "docs", "kernels.md"), os.path.join(harness.ROOT, "docs", "server.md"),
         os.path.join(harness.ROOT, "docs", "engine.md"), os.path.join(harness.ROOT, "docs", "kv_dtypes.md"))
MARKER = re.compile(r"<!-- table (\S+) -->\n.*?<!-- end table -->", re.S)


@dataclass
class Table:
    result: str | tuple[str, ...]             # under benchmarks/results/: one file, or several
    rows: Callable[..., list[dict]]           # the result's tables (one argument per file) -> the rows shown
    columns: dict[str, Callable[[dict], str]]  # header -> a row's cell

    @property
    def results(self) -> tuple[str, ...]:
        return (self.result,) if isinstance(self.result, str) else self.result


# -- cells -------------------------------------------------------------------------------

def num(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def pct(value: float, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}%"


def times(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}x"


def seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def spread(s: dict, cell: Callable[[float], str] = times) -> str:
    """A median and the range of the runs it is the median of."""
    if s["low"] == s["high"]:
        return cell(s["median"])
    return f"{cell(s['median'])} ({cell(s['low']).rstrip('x')}-{cell(s['high'])})"


def key(name: str, cell: Callable = str) -> Callable[[dict], str]:
    return lambda row: cell(row[name])


def rows_of(name: str, where: Callable[[dict], bool] = lambda row: True) -> Callable[..., list[dict]]:
    """The rows of table `name`, of every file in turn."""
    return lambda *results: [row for tables in results for row in tables[name] if where(row)]


# -- the tables --------------------------------------------------------------------------

def manager_rows(t: dict) -> list[dict]:
    """hybridkv's row, vLLM's, and the decode step's cost across the pool
    sizes and contexts, on the mixed trace."""
    theirs = {row["model"]: row for row in t.get("vllm", []) if row.get("trace", "mixed") == "mixed"}
    out = []
    for row in (row for row in t["models"] if row.get("trace", "mixed") == "mixed"):
        scaled = [r for r in t["scaling"] if r["model"] == row["model"]]
        us = [r["us_per_decode_step"] for r in scaled]
        out.append({**row, "vllm": theirs[row["model"]],
                    "scaled": (min(us), max(us)),
                    "pools": (min(r["pool_pages"] for r in scaled), max(r["pool_pages"] for r in scaled)),
                    "contexts": (min(r["context"] for r in scaled), max(r["context"] for r in scaled))})
    return out


def manager_trace_rows(t: dict) -> list[dict]:
    """Per model and trace but the mixed one (the manager table's): hybridkv's
    row with vLLM's beside it."""
    theirs = {(row["model"], row["trace"]): row for row in t.get("vllm", []) if "trace" in row}
    return [{**row, "vllm": theirs[row["model"], row["trace"]]}
            for row in t["models"] if (row["model"], row.get("trace")) in theirs and row.get("trace") != "mixed"]


def routing_rows(t: dict) -> list[dict]:
    """Per layout: each router's saved tokens over the single cache's (the
    hybrid router's also at each price of a queued request), misroutes, time."""
    out = []
    for layout in t["layouts"]:
        name = layout["layout"]
        routers = {row["router"]: row for row in t["routers"] if row["layout"] == name}
        single = routers["single cache"]["hit_tokens"]
        out.append({"layout": name, "memory": layout["memory"],
                    **{router: row["hit_tokens"] / single for router, row in routers.items()},
                    **{row["queued_request_tokens"]: row["hit_tokens"] / single
                       for row in t["sweep"] if row["layout"] == name},
                    "misroutes": routers["token prefix"]["misroute_rate"],
                    "us_token": routers["token prefix"]["us_per_decision"],
                    "us_hybrid": routers["hybrid"]["us_per_decision"]})
    return out


def real_gemma3_rows(t: dict) -> list[dict]:
    """One row per workload, a cell per engine."""
    described = {w["workload"]: w for w in t["workloads"]}
    out = []
    for name, w in described.items():
        row = {"workload": w, **{c["engine"]: c for c in t["medians"] if c["workload"] == name}}
        row["ratios"] = {r["engine"]: r for r in t["ratios"] if r["workload"] == name}
        out.append(row)
    return out


WORKLOADS = {
    "batch-1": "batch 1: 128-token prompt, 64 new", "batch-16": "batch 16: 128-token prompts, 64 new",
    "batch-64": "batch 64: 128-token prompts, 64 new",
    "shared-64": "64 questions sharing a ~300-token preamble, 32 new",
    "long-16": "16 prompts of 700 tokens (past the 512 window), 32 new",
    "staggered": "32 questions sharing the preamble, one every 100 ms, 32 new",
}


def engine_cell(engine: str) -> Callable[[dict], str]:
    return lambda row: (f"{num(row[engine]['tokens_per_s'], 1)} ({seconds(row[engine]['ttft_mean'])})"
                        if engine in row else "-")


def ratio_cell(engine: str) -> Callable[[dict], str]:
    return lambda row: spread(row["ratios"][engine]) if engine in row["ratios"] else "-"


def real_gemma3_table(engines: list[str], ratios: list[str], result: str = "real_gemma3.json") -> Table:
    columns = {"workload": lambda row: WORKLOADS.get(row["workload"]["workload"], row["workload"]["workload"])}
    columns.update({engine: engine_cell(engine) for engine in engines})
    columns.update({f"hybridkv / {engine}": ratio_cell(engine) for engine in ratios})
    return Table(result, real_gemma3_rows, columns)


def bound_table(result: str) -> Table:
    """Each engine's batch-1 run against the weights-read bound of its steps."""
    return Table(result, lambda t: t["weights_read_bound"]["engines"], {
        "engine": key("engine"), "weights a step reads": key("weights_mib", lambda v: f"{num(v)} MiB"),
        "bound (memory read / weights)": key("bound_tokens_per_s", lambda v: f"{num(v, 1)} tok/s"),
        "batch 1, prefill included": lambda r: f"{num(r['tokens_per_s'], 1)} tok/s ({100 * r['fraction']:.0f}%)",
        "its decode steps alone": lambda r: (f"{num(r['decode_tokens_per_s'], 1)} tok/s "
                                             f"({100 * r['decode_fraction']:.0f}%)" if "decode_fraction" in r
                                             else "not recorded")})


def kv_capacity_rows(t: dict) -> list[dict]:
    """One row per model and narrow dtype (those it has: no full-only row
    where every attention layer is full, or none is), then vLLM's fp8 pages
    where the run had vLLM."""
    names = {"int8": "int8", "fp8": "fp8", "int8 full only": "int8 full only", "vllm fp8": "vLLM fp8"}
    return [{"model": row["model"], "pages": shown, **row[name]} for row in t["capacity"]["rows"]
            for name, shown in names.items() if name in row]


def kv_capacity_cell(context: int) -> Callable[[dict], str]:
    """The ratio and, in brackets, the byte-exact one; a dash where vLLM
    could not lay the model out (the page says why)."""
    return lambda row: "—" if "unavailable" in row else \
        f"{times(row[str(context)]['ratio'])} ({times(row[str(context)]['exact'])})"


def readme_rows(t: dict) -> list[dict]:
    """The workloads, then each engine's load time."""
    return real_gemma3_rows(t) + [{"workload": {"workload": "engine load"},
                                   "load": {row["engine"]: row["load_s"] for row in t["engines"]}}]


def readme_cell(engine: str) -> Callable[[dict], str]:
    return lambda row: (seconds(row["load"][engine]) if engine in row["load"] else "-") if "load" in row \
        else engine_cell(engine)(row)


def cpu_step_cell(name: str) -> Callable[[dict], str]:
    return lambda row: f"{row[name] * 1e3:.1f} ms ({row['batch'] / row[name]:.0f})" if name in row else "-"


def kernel_rows(t: dict) -> list[dict]:
    return [row for row in t["kernels"] if row["kernel"].startswith("paged") and row["shape"] in
            ("64 x 8192", "2048 after 6144")]


def prefill_sweep_rows(t: dict) -> list[dict]:
    """The prefill kernel's sweep per layer kind: its four fastest configs
    and the float32-tile default of before (32 x 64, 8 warps), each beside
    FlashInfer's time on the same pool."""
    out = []
    for row in (r for r in t["kernels"] if r["kernel"] == "paged prefill attention"):
        configs = []
        for name, value in row["sweep_us"].items():
            if isinstance(value, str):  # a config that did not compile
                continue
            cfg = dict(part.split("=") for part in name.split())
            configs.append({"kind": row["kind"], "us": value, "flashinfer_us": row["flashinfer"]["seconds"] * 1e6,
                            "tiles": f"{cfg['block_m']} x {cfg['block_n']}, {cfg['warps']}, {cfg['stages']}",
                            "dots": "16-bit" if cfg["dot16"] == "1" else "float32 tiles"})
        configs.sort(key=lambda c: c["us"])
        out += configs[:4] + [c for c in configs[4:] if c["tiles"] == "32 x 64, 8, -" and c["dots"] != "16-bit"]
    return out


def us(value: float | None) -> str:
    return "-" if value is None else num(value * 1e6, 1)


TABLES: dict[str, Table] = {
    "kv-dtypes-capacity": Table("kv_dtypes_capacity.json", kv_capacity_rows, {
        "model": key("model"), "pages": key("pages"),
        **{f"{c:,} tokens": kv_capacity_cell(c) for c in (1024, 4096, 32768)}}),
    # float32 weights, the engines made in each order (--reverse)
    "kv-dtypes-speed": Table(("kv_dtypes_speed.json", "kv_dtypes_speed_reversed.json"),
                             lambda *runs: [row for t in runs for row in t["speed"]["rows"]], {
        "engines made": lambda r: ", ".join({"auto": "float32"}.get(m, m)
                                            for m in r.get("made", ("auto", "int8", "fp8_e4m3"))),
        "batch": key("batch"), "context": key("context", num),
        "float32 pages": lambda r: f"{num(r['auto']['step_ms'], 1)} ms ({num(r['auto']['tokens_per_s'])} tok/s)",
        "int8 pages": lambda r: f"{num(r['int8']['step_ms'], 1)} ms ({num(r['int8']['tokens_per_s'])} tok/s)",
        "int8 / float32": key("speedup", times),
        "fp8_e4m3 pages": lambda r: f"{num(r['fp8_e4m3']['step_ms'], 1)} ms ({num(r['fp8_e4m3']['tokens_per_s'])} tok/s)",
        "fp8_e4m3 / float32": key("speedup_fp8", times)}),
    # The same over bfloat16 weights (--weights bfloat16): float32 pages against bfloat16 and int8 ones,
    # the engines made in each order (--reverse).
    "kv-dtypes-speed-bfloat16": Table(("kv_dtypes_speed_bfloat16.json", "kv_dtypes_speed_bfloat16_reversed.json"),
                                      lambda *runs: [row for t in runs for row in t["speed"]["rows"]], {
        "engines made": lambda r: ", ".join(r.get("made", ("float32", "bfloat16", "int8"))),
        "batch": key("batch"), "context": key("context", num),
        **{f"{pages} pages": (lambda pages: lambda r: f"{num(r[pages]['step_ms'], 1)} ms "
                                                      f"({num(r[pages]['tokens_per_s'])} tok/s)")(pages)
           for pages in ("float32", "bfloat16", "int8")},
        "bfloat16 / float32": key("speedup_bf16", times), "int8 / float32": key("speedup", times),
        "int8 / bfloat16": key("int8_over_bf16", times),
        # The floor (int8 pages at short contexts, stepped beside the others) and the most any page dtype
        # could gain over float32 pages: their step over the floor's. Rows without one (batch 1): "-".
        "floor": lambda r: f"{num(r['floor']['step_ms'], 1)} ms ({num(r['floor']['context'])} tokens)"
                           if "floor" in r else "-",
        "float32 / floor": lambda r: times(r["ceiling"]) if "ceiling" in r else "-"}),
    "kv-dtypes-accuracy": Table("kv_dtypes.json", lambda t: t["accuracy"]["rows"], {
        "pages": key("config"), "dtypes": lambda r: ", ".join(r["pages"]), "positions": key("positions", num),
        "top-1 agreement": key("top1_agreement", lambda v: pct(v, 2)),
        "perplexity": key("perplexity", lambda v: num(v, 3)),
        "change": key("perplexity_change", lambda v: f"{100 * v:+.2f}%")}),
    "kv-dtypes-tiers": Table(("kv_tiers.json", "kv_tiers_int8.json"), lambda *results: [
        {**row, "pages": {"auto": "float32"}.get(t["workload"][0].get("kv_cache_dtype", "auto"),
                                                 t["workload"][0].get("kv_cache_dtype"))}
        for t in results for row in t["tiers"]], {
        "pages": key("pages"), "tier": key("tier"), "mean TTFT": key("mean_ttft_s", seconds),
        "vs none": key("speedup", times), "prompt tokens from cache": key("cached_fraction", lambda v: pct(v, 0)),
        "B stored per cached token": lambda r: num(r["stored_bytes_per_cached_token"])
        if "stored_bytes_per_cached_token" in r else "-"}),
    "kv-int8-options": Table("kv_int8_options.json", lambda t: t["rows"], {
        "variant": key("variant"), "positions": key("positions", num),
        "top-1 agreement": key("top1_agreement", lambda v: pct(v, 2)),
        "perplexity": key("perplexity", lambda v: num(v, 3)),
        "change": key("perplexity_change", lambda v: f"{100 * v:+.2f}%")}),
    "manager": Table("manager_overhead.json", manager_rows, {
        "model": key("model"), "groups": key("groups"),
        "µs / admission": key("us_per_admission", lambda v: num(v, 0)),
        "µs / decode step": key("us_per_decode_step", lambda v: num(v, 2)), "hit rate": key("hit_rate", pct),
        "vLLM groups": lambda r: str(r["vllm"]["groups"]),
        "vLLM µs / admission": lambda r: num(r["vllm"]["us_per_admission"], 0),
        "vLLM µs / decode step": lambda r: num(r["vllm"]["us_per_decode_step"], 2),
        "vLLM hit rate": lambda r: pct(r["vllm"]["hit_rate"]),
        "admission x": lambda r: times(r["vllm"]["admission_ratio"]),
        "decode x": lambda r: times(r["vllm"]["decode_ratio"], 1),
        "µs / decode step at other pools and contexts": lambda r: (
            f"{r['scaled'][0]:.2f}-{r['scaled'][1]:.2f} ({num(r['pools'][0])}-{num(r['pools'][1])} pages, "
            f"{num(r['contexts'][0])}-{num(r['contexts'][1])} tokens)")}),
    "manager-traces": Table("manager_overhead.json", manager_trace_rows, {
        "model": key("model"), "trace": key("trace"), "prompt tokens": key("prompt_tokens", num),
        "hit tokens": key("hit_tokens", num), "vLLM hit tokens": lambda r: num(r["vllm"]["hit_tokens"]),
        "hit x": lambda r: "-" if r["vllm"]["hit_ratio"] is None else times(r["vllm"]["hit_ratio"]),
        "µs / admission": key("us_per_admission", lambda v: num(v, 0)),
        "vLLM µs / admission": lambda r: num(r["vllm"]["us_per_admission"], 0),
        "admission x": lambda r: times(r["vllm"]["admission_ratio"]),
        "µs / decode step": key("us_per_decode_step", lambda v: num(v, 2)),
        "vLLM µs / decode step": lambda r: num(r["vllm"]["us_per_decode_step"], 2),
        "decode x": lambda r: times(r["vllm"]["decode_ratio"], 1)}),
    "events": Table("manager_overhead_events.json", rows_of("events"), {
        "model": key("model"), "µs / admission, off": lambda r: num(r["off"]["us_per_admission"], 1),
        "on": lambda r: f"{num(r['on']['us_per_admission'], 1)} ({r['admission_change']:+.0%})",
        "µs / decode step, off": lambda r: num(r["off"]["us_per_decode_step"], 2),
        "on ": lambda r: f"{num(r['on']['us_per_decode_step'], 2)} ({r['decode_change']:+.0%})"}),
    "event-wire": Table("kv_event_wire.json", rows_of("models"), {
        "model": key("model"), "batches": key("batches", num), "events": key("events", num),
        "blocks stored": key("blocks_stored", num), "removed": key("blocks_removed", num),
        "µs / batch encode": key("us_per_batch_encode", lambda v: num(v, 1)),
        "B / stored block": key("bytes_per_stored_block", num),
        "batches/s over ZMQ": lambda r: num(r["zmq_batches_per_s"]) if r["zmq_batches_per_s"] else "lost",
        "vLLM 0.32's decoder": key("vllm_decoder")}),
    "handoff-bytes": Table("handoff_bytes.json", rows_of("models"), {
        "model": key("model"), "block": key("block_size"),
        "groups": lambda r: ", ".join(sorted(set(r["groups"]))),
        **{f"{int(t):,}-token prompt": (lambda t: lambda r: (
            f"{num(r['prompts'][t]['bytes'] / 2**20, 1)} MiB, {pct(r['prompts'][t]['fraction'], 0)}"))(t)
           for t in ("1024", "4096", "32768")}}),
    "disaggregated": Table("disaggregated.json", rows_of("configs"), {
        "replicas": key("config"), "mean TTFT": key("ttft_mean_ms", lambda v: f"{num(v)} ms"),
        "p90": key("ttft_p90_ms", lambda v: f"{num(v)} ms"),
        "time between tokens": key("itl_mean_ms", lambda v: f"{num(v, 1)} ms"),
        "p90 ": key("itl_p90_ms", lambda v: f"{num(v, 1)} ms"),
        "output tok/s": key("output_tok_per_s", lambda v: num(v, 1)),
        "prompt tokens from cache": key("cached_fraction", pct)}),
    "disaggregated-transfer": Table("disaggregated.json", rows_of("transfer"), {
        "prompt tokens": key("prompt_tokens", num), "shipped": key("bytes", lambda v: f"{num(v / 2**20, 2)} MiB"),
        "of every layer's": lambda r: pct(r["bytes"] / r["all_layers_bytes"], 0),
        "written": key("write_ms", lambda v: f"{num(v, 2)} ms"), "read": key("read_ms", lambda v: f"{num(v, 2)} ms")}),
    "memory": Table("memory.json", rows_of("models"), {
        "model": key("model"), "groups": key("groups"), "waste": key("waste_fraction", lambda v: pct(v, 4)),
        "padded groups": key("padded_groups"), "padding layers": key("padding_layers"),
        "padded waste": key("padded_waste_fraction", lambda v: pct(v, 2)),
        **{f"fit at {label}": (lambda c: lambda r: " / ".join(str(r["mix"][c][k]) for k in
                                                             ("hybridkv", "contiguous", "padded", "exact")))(c)
           for label, c in (("1K", "1024"), ("8K", "8192"), ("32K", "32768"), ("128K", "131072"))}}),
    "checkpoints": Table("hybrid_prefix.json", rows_of("budgets"), {
        "KV budget": key("budget"), "every block": lambda r: pct(r["every_block"]["hit_rate"]),
        "prompt end": lambda r: pct(r["prompt_end"]["hit_rate"]), "hybridkv": lambda r: pct(r["hybridkv"]["hit_rate"]),
        "hybridkv / every block": key("ratio_vs_every_block", lambda v: times(v, 1)),
        "prefill tokens not recomputed": lambda r: num(r["hybridkv"]["hit_tokens"])}),
    "tiers": Table(("kv_tiers.json", "kv_tiers_tp2.json"), rows_of("tiers"), {
        "ranks": lambda r: str(r.get("ranks", 1)), "tier": key("tier"), "mean TTFT": key("mean_ttft_s", seconds), "p90": key("p90_ttft_s", seconds),
        "vs none": key("speedup", times), "prompt tokens from cache": key("cached_fraction", lambda v: pct(v, 0)),
        "prefill tok/s": key("prompt_tok_per_s", num)}),
    "tiers-restart": Table("kv_tiers.json", rows_of("restart"), {
        "prompt tokens": key("prompt_tokens", num), "from disk": key("cached_tokens", num),
        "first TTFT, restarted with the disk tier": key("first_ttft_s", seconds),
        "fresh engine": key("cold_ttft_s", seconds), "gain": key("speedup", lambda v: times(v, 1))}),
    "cache-identity": Table("cache_identity.json", rows_of("identity"), {
        "model": key("model"), "files": key("bytes", lambda v: f"{num(v / 2**20)} MiB"), "digest": key("digest"),
        "time": key("ms", lambda v: f"{num(v['median'], 1)} ms")}),
    "vllm-connector": Table("vllm_connector.json", rows_of("configs"), {
        "config": key("config"), "mean TTFT": key("mean_ttft_s", seconds), "p90": key("p90_ttft_s", seconds),
        "vs vLLM alone": key("speedup", times), "requests/s": key("requests_per_s", lambda v: num(v, 2)),
        "prompt tokens from cache": key("cached_fraction", lambda v: pct(v, 0)),
        "from vLLM's pool": key("pool_tokens", num),
        "from the tiers, each group": lambda r: num(r["tier_tokens"]) if r["tier_tokens"] else "-"}),
    "vllm-connector-restart": Table("vllm_connector.json", rows_of("restart"), {
        "prompt tokens": key("prompt_tokens", num), "from disk": key("cached_tokens", num),
        "first TTFT, restarted with the disk tier": key("first_ttft_s", seconds),
        "fresh vLLM alone": key("cold_ttft_s", seconds), "gain": key("speedup", lambda v: times(v, 1))}),
    "tiers-stored": Table(("kv_tiers.json", "kv_tiers_tiny-jamba.json"), lambda *results: [
        {**row, **t["workload"][0]} for t in results for row in t["tiers"] if row["tier"] == "host"], {
        "model": key("model"), "MiB stored by group": lambda r: " / ".join(
            f"{num(b / 2**20, 2)} {g.replace('_', ' ')}" for g, b in zip(r["groups"], r["stored_bytes_by_group"])),
        "B per cached token": key("stored_bytes_per_cached_token", num),
        "store-everything": key("store_everything_bytes_per_cached_token", num),
        "ratio": lambda r: times(r["store_everything_bytes_per_cached_token"] / r["stored_bytes_per_cached_token"])}),
    "prefix-index": Table("prefix_index.json", rows_of("index"), {
        "blocks stored": key("blocks_stored", num), "distinct keys": key("keys_indexed", num),
        "replicas": key("replicas"), "bytes / block stored": key("bytes_per_block", num),
        "µs per `best`": key("us_per_best", num), "of which hashing the prompt": key("us_hashing_per_request", num),
        "prompt tokens": key("probe_tokens", num)}),
    "routing": Table("replica_routing.json", routing_rows, {
        "layout (KV per replica)": lambda r: f"{r['layout']} ({r['memory']})",
        "round robin": key("round robin", pct), "token prefix": key("token prefix", pct),
        "hybrid (hit only)": key("hybrid (hit only)", pct), "hybrid": key("hybrid", pct),
        "token prefix's misroutes": key("misroutes", pct),
        "µs / request, token prefix": key("us_token", num), "hybrid ": key("us_hybrid", num),
        "hybrid at 0 / 64 / 1,024 tokens a queued request": lambda r: " / ".join(pct(r[v]) for v in (0, 64, 1024))}),
    "ray": Table(("ray_replicas.json", "ray_replicas_gemma3_270m.json"), rows_of("routers"), {
        "model": lambda r: "Gemma-3 270M" if r["model"] == "gemma3-270m" else r["model"],
        "router": lambda r: "hybrid" if r["router"] == "hybrid" else "Ray Serve's default",
        "hit rate": key("hit_rate", pct), "TTFT mean": key("ttft_mean_ms", lambda v: f"{v:.0f} ms"),
        "p50": key("ttft_p50_ms", lambda v: f"{v:.0f} ms"), "p90": key("ttft_p90_ms", lambda v: f"{v:.0f} ms")}),
    "tensor-parallel": Table("tensor_parallel.json", rows_of("steps"), {
        "code": lambda r: r.get("code", "this tree"),
        "batch": key("batch"), "ranks": key("tp"), "ms / decode step": key("ms_per_decode_step", lambda v: num(v, 1)),
        "host ms / step": lambda r: num(r["host_ms_per_step"], 2) if "host_ms_per_step" in r else "-",
        "tok/s": key("tokens_per_s", lambda v: num(v, 1)),
        "all-reduces / step": lambda r: num(r["all_reduces_per_step"]) if "all_reduces_per_step" in r else "-",
        "all-reduced / step": lambda r: (f"{r['all_reduce_bytes_per_step'] / 2**10:,.0f} KiB"
                                         if "all_reduce_bytes_per_step" in r else "-"),
        "plan / step": lambda r: f"{r['plan_bytes_per_step']:,.0f} B" if "plan_bytes_per_step" in r else "-",
        "plan µs / step": lambda r: num(r["plan_us_per_step"]) if "plan_us_per_step" in r else "-",
        "same tokens": lambda r: "yes" if r["same_tokens"] else "no"}),
    "recurrent-prefill": Table("recurrent_prefill.json", rows_of("prefill"), {
        "model": key("model"), "code": key("code"), "block size": key("block_size"),
        "TTFT mean": key("ttft_mean", seconds), "p90": key("ttft_p90", seconds), "hit rate": key("hit_rate", pct),
        "steps": key("steps"), "a lone 560-token prompt's steps": key("lone_prompt_steps")}),
    "recurrent-kernels": Table("recurrent_kernels.json", rows_of("tokens"), {
        "kind": lambda r: {"gated_delta": "Gated DeltaNet", "ssd": "Mamba-2"}[r.get("kind", "gated_delta")],
        "heads": key("shape"), "work": key("work"), "requests": key("requests"),
        "tokens each": key("tokens"), "torch reference µs / token": key("reference_us_per_token", lambda v: num(v, 2)),
        "C µs / token": key("c_us_per_token", lambda v: num(v, 2)), "speed-up": key("speedup", times)}),
    "tensor-parallel-families": Table("tensor_parallel_families.json", rows_of("steps"), {
        "model": key("model"), "ranks": key("tp"), "ms / decode step": key("ms_per_decode_step", lambda v: num(v, 1)),
        "tok/s": key("tokens_per_s", lambda v: num(v, 0)), "of one process": key("vs_one_process", times),
        "all-reduces / step": lambda r: num(r["all_reduces_per_step"]) if "all_reduces_per_step" in r else "-",
        "all-reduced / step": lambda r: (f"{r['all_reduce_bytes_per_step'] / 2**10:,.0f} KiB"
                                         if "all_reduce_bytes_per_step" in r else "-"),
        "same tokens": lambda r: "yes" if r["same_tokens"] else "no"}),
    "engine": Table("engine_throughput.json", rows_of("throughput"), {
        "model": key("model"), "transformers tok/s": lambda r: num(r["transformers"]["tokens_per_s"]),
        "hybridkv tok/s": lambda r: num(r["hybridkv"]["tokens_per_s"]), "speedup": key("speedup", times),
        "per-pair speedups": lambda r: " / ".join(f"{h['tokens_per_s'] / t['tokens_per_s']:.2f}" for t, h in
                                                  zip(r["runs"]["transformers"], r["runs"]["hybridkv"])),
        "TTFT mean / p90, transformers": lambda r: f"{seconds(r['transformers']['ttft_mean'])} / "
                                                   f"{seconds(r['transformers']['ttft_p90'])}",
        "hybridkv": lambda r: f"{seconds(r['hybridkv']['ttft_mean'])} / {seconds(r['hybridkv']['ttft_p90'])}",
        "peak RSS MiB, transformers / hybridkv": lambda r: f"{num(r['transformers']['peak_rss_mib'])} / "
                                                           f"{num(r['hybridkv']['peak_rss_mib'])}"}),
    "engine-tiny-families": Table("engine_throughput_tiny_families.json", rows_of("throughput"), {
        "model": key("model"), "transformers tok/s": lambda r: num(r["transformers"]["tokens_per_s"], 1),
        "hybridkv tok/s": lambda r: num(r["hybridkv"]["tokens_per_s"], 1), "speedup": key("speedup", times),
        "per-pair speedups": lambda r: " / ".join(f"{h['tokens_per_s'] / t['tokens_per_s']:.2f}" for t, h in
                                                  zip(r["runs"]["transformers"], r["runs"]["hybridkv"])),
        "TTFT mean, transformers / hybridkv": lambda r: f"{seconds(r['transformers']['ttft_mean'])} / "
                                                        f"{seconds(r['hybridkv']['ttft_mean'])}",
        "peak RSS MiB, transformers / hybridkv": lambda r: f"{num(r['transformers']['peak_rss_mib'])} / "
                                                           f"{num(r['hybridkv']['peak_rss_mib'])}"}),
    "shared-prefix": Table(("engine_throughput.json", "engine_throughput_shared_1024.json"),
                           rows_of("shared_prefix"), {
        "model": key("model"), "tokens per step": key("batch_tokens", num),
        "TTFT off": lambda r: seconds(r["off"]["ttft_mean"]), "TTFT on": lambda r: seconds(r["on"]["ttft_mean"]),
        "gain": key("ttft_gain", lambda v: times(v, 1)), "hit rate": lambda r: pct(r["on"]["hit_rate"]),
        "per-pair gains": lambda r: " / ".join(f"{a['ttft_mean'] / b['ttft_mean']:.2f}"
                                               for a, b in zip(r["runs"]["off"], r["runs"]["on"]))}),
    "prefill-tiles": Table(("prefill_tiles.json", "prefill_tiles_gemma3_270m.json",
                            "prefill_tiles_gemma3_270m_bfloat16.json"), rows_of("models"), {
        "model": key("model"), "dtype": lambda r: r.get("dtype", "float32"), "prompts": key("prompts"),
        "one masked call": key("one_call_s", seconds), "query tiles": key("query_tiles_s", seconds),
        "speedup": key("speedup", times),
        "tiles, torch's softmax": lambda r: seconds(r["torch_softmax_s"]) if "torch_softmax_s" in r else "not run",
        "C softmax": lambda r: times(r["c_softmax_speedup"]) if "c_softmax_speedup" in r else "not run"}),
    # The CPU's decode attention over long rows, this build beside a baseline revision's.
    "decode-attention": Table("decode_attention.json", rows_of("cases"), {
        "pages": key("dtype"), "keys a row reads": key("keys", num), "rows": key("rows"),
        "this build": lambda r: f"{num(r['this']['ms'], 2)} ms ({num(r['this']['gb_per_s'], 1)} GB/s)",
        "baseline": lambda r: (f"{num(r['baseline']['ms'], 2)} ms ({num(r['baseline']['gb_per_s'], 1)} GB/s)"
                               if "baseline" in r else "not run"),
        "speedup": lambda r: times(r["speedup"]) if "speedup" in r else "-"}),
    # bfloat16 prefill attention on AMX tiles (kernels.c prefill_attention) against the tiles' path, on a Xeon.
    "prefill-amx": Table("prefill_tiles_gemma3_270m_bfloat16_amx.json", rows_of("models"), {
        "model": key("model"), "dtype": key("dtype"), "prompts": key("prompts"),
        "query tiles (oneDNN products, C softmax)": key("query_tiles_s", seconds),
        "AMX kernel": lambda r: seconds(r["amx_s"]) if "amx_s" in r else "not run",
        "speedup": lambda r: times(r["amx_speedup"]) if "amx_speedup" in r else "-",
        "one masked call": key("one_call_s", seconds)}),
    "real-gemma3": real_gemma3_table(["hybridkv", "vllm"], ["vllm"]),
    "real-gemma3-bfloat16": real_gemma3_table(["hybridkv", "vllm", "llama.cpp", "llama.cpp Q8_0"],
                                              ["vllm", "llama.cpp", "llama.cpp Q8_0"], "real_gemma3_bfloat16.json"),
    "real-gemma3-bound": bound_table("real_gemma3_bfloat16.json"),
    # The same run on a second machine (an Intel Xeon with AMX), hybridkv and vLLM.
    "real-gemma3-bfloat16-amx": real_gemma3_table(["hybridkv", "vllm"], ["vllm"], "real_gemma3_bfloat16_amx.json"),
    "real-gemma3-bfloat16-amx-cache": real_gemma3_table(["hybridkv", "vllm"], ["vllm"],
                                                        "real_gemma3_bfloat16_amx_cache.json"),
    "real-gemma3-engines": Table("real_gemma3.json", rows_of("engines"), {
        "engine": key("engine"), "version": lambda r: r["version"] or "not recorded",
        "settings": lambda r: ", ".join(f"{k}={v}" for k, v in {**r["env"], **r["options"]}.items()
                                        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING"))
        or ("its defaults" if r["runner"] != "hybridkv" else "-"),
        "load": key("load_s", seconds), "peak RSS": key("peak_rss_mib", lambda v: f"{num(v)} MiB")}),
    "readme-real-gemma3": Table("real_gemma3_bfloat16.json", readme_rows, {
        "workload": lambda r: WORKLOADS.get(r["workload"]["workload"], r["workload"]["workload"]),
        "hybridkv, bfloat16": readme_cell("hybridkv"), "vLLM's CPU build, bfloat16": readme_cell("vllm"),
        "llama.cpp, Q4_K_M": readme_cell("llama.cpp"), "llama.cpp, Q8_0": readme_cell("llama.cpp Q8_0")}),
    "cpu-decode-step": Table("cpu_decode_step.json", rows_of("steps"), {
        "batch": key("batch"), "engine": cpu_step_cell("engine_s"),
        "larger steps through the modules": cpu_step_cell("no_stages_s"),
        "layers through the modules": cpu_step_cell("layer_modules_s"),
        "+ decode attention gathered (the reference)": cpu_step_cell("gathered_decode_s"),
        "+ norms, rotary, activation as torch ops": cpu_step_cell("torch_elementwise_s"),
        "the tied LM head read dense": cpu_step_cell("dense_LM_head_s")}),
    "cpu-decode-floor": Table("cpu_decode_step.json", rows_of("batch1"), {
        "weights read per step": key("weight_bytes", lambda v: f"{v / 1e9:.2f} GB"),
        "reading them once": lambda r: f"{r['read_s'] * 1e3:.1f} ms "
                                       f"({r['weight_bytes'] / r['read_s'] / 1e9:.0f} GB/s)",
        "the Linear modules alone": lambda r: f"{r['linears_s'] * 1e3:.1f} ms ({r['linears_s'] / r['read_s']:.2f}x)",
        "the engine's step": lambda r: f"{r['step_s'] * 1e3:.1f} ms ({r['step_s'] / r['read_s']:.2f}x)"}),
    "speculative": Table("speculative.json", rows_of("cells", lambda row: row["model"] != "tiny-gemma3"), {
        "model": key("model"), "workload": key("workload"),
        "transformers": lambda r: num(r["transformers"]["tokens_per_s"], 1),
        "+ lookup": lambda r: (num(r["transformers+lookup"]["tokens_per_s"], 1) if "transformers+lookup" in r
                               else "n/a"),
        "hybridkv": lambda r: num(r["hybridkv"]["tokens_per_s"], 1),
        "+ ngram": lambda r: num(r["hybridkv+ngram"]["tokens_per_s"], 1),
        "drafts kept": lambda r: f"{r['hybridkv+ngram']['accepted']}/{r['hybridkv+ngram']['drafts']}",
        "ngram / plain": lambda r: times(r["hybridkv+ngram"]["tokens_per_s"] / r["hybridkv"]["tokens_per_s"]),
        "same": lambda r: {True: "yes", False: "no", None: "-"}[r["identical"]["hybridkv"]]}),
    "h100-decode-steps": Table(("h100-2026-11-26/profile_before.json", "h100-2026-11-26/profile.json",
                                "h100-2026-11-27/profile.json"),
                               lambda before, after, now: [dict(r, tree="before (8db694d)") for r in before["cases"]] +
                               [dict(r, tree="one kernel per norm (5281801)") for r in after["cases"]] +
                               [dict(r, tree="the plan and the worker (322b901)") for r in now["cases"]], {
        "tree": key("tree"), "batch": key("batch"),
        "step ms": key("step_ms", lambda v: num(v, 2)), "kernels ms": key("kernel_ms", lambda v: num(v, 2)),
        "launches per step": key("launches", lambda v: num(v)),
        "of the weights-read bound": lambda r: f"{100 * r['bound_ms'] / r['step_ms']:.0f}%"}),
    "h100-engine": Table(("h100-2026-11-27/engine_gemma3_before.json", "h100-2026-11-27/engine_gemma3.json",
                          "h100-2026-11-27/engine_jamba.json"),
                         lambda before, after, jamba: [dict(r, prefill="float32 tiles")
                                                       for r in before["throughput"] + jamba["throughput"]]
                         + [dict(r, prefill="16-bit dots") for r in after["throughput"]], {
        "model": key("model"), "batch": key("batch"), "prefill kernel": key("prefill"),
        "tok/s": lambda r: num(r["triton"]["tokens_per_s"], 1),
        "TTFT mean s": lambda r: num(r["triton"]["ttft_mean"], 3),
        "weights-read bound tok/s": key("weight_bound_tokens_per_s", lambda v: num(v))}),
    "h100-prefill": Table("h100-2026-11-27/prefill.json", prefill_sweep_rows, {
        "layer": lambda r: r["kind"].replace("_", " "), "tiles (queries x keys), warps, stages": key("tiles"),
        "dots": key("dots"), "µs": key("us", lambda v: num(v, 1)),
        "FlashInfer µs": key("flashinfer_us", lambda v: num(v, 1)),
        "ours / FlashInfer": lambda r: f"{r['us'] / r['flashinfer_us']:.2f}x"}),
    "h100-kernels": Table("h100-2026-11-25/kernels.json", kernel_rows, {
        "kernel (Gemma-3-27B heads, bf16, batch 64)": lambda r: f"{r['kernel']}, {r['kind'].replace('_', ' ')}, "
                                                                 f"{r['shape']}",
        "hybridkv µs": key("seconds", us),
        "best tiles of the sweep µs": lambda r: num(min(r["sweep_us"].values()), 1)
        if r.get("sweep_us") and r["kernel"].endswith("decode attention") else "-",
        "FlashInfer µs": lambda r: us(r.get("flashinfer", {}).get("seconds")),
        "contiguous SDPA µs": lambda r: us(r.get("sdpa_seconds"))}),
}


# -- the page ----------------------------------------------------------------------------

def load(result: str) -> dict:
    with open(os.path.join(harness.RESULTS, result)) as f:
        return json.load(f)


def caption(result: str, data: dict) -> str:
    env = data["environment"]
    commit = f", commit {env['commit']}" if env.get("commit") else ""
    return f"`{result}`, {data['date'][:10]}, {harness.machine(env)}{commit}: `{data['command']}`"


def markdown(name: str, captioned: bool = True) -> str:
    """Table `name` in markdown, under its caption unless `captioned` is false."""
    table = TABLES[name]
    data = [load(result) for result in table.results]
    rows = table.rows(*(d["tables"] for d in data))
    lines = [caption(result, d) + (";" if i < len(data) - 1 else "")
             for i, (result, d) in enumerate(zip(table.results, data))] + [""] if captioned else []
    lines += ["| " + " | ".join(h.strip() for h in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(row) for cell in table.columns.values()) + " |" for row in rows]
    return "\n".join(lines)


def render(page: str, seen: list[str] | None = None) -> str:
    """The page with every marked table written from its result files; the
    names of the tables it marks are added to `seen`."""
    seen = [] if seen is None else seen
    previous = []

    def replace(match: re.Match) -> str:
        name = match[1]
        if name not in TABLES:
            raise KeyError(f"a page marks a table {name!r} that benchmarks/render.py does not know")
        same = bool(previous) and TABLES[previous[-1]].results == TABLES[name].results
        previous.append(name)
        return f"<!-- table {name} -->\n{markdown(name, captioned=not same)}\n<!-- end table -->"

    out = MARKER.sub(replace, page)
    seen.extend(previous)
    return out


def rendered() -> dict[str, tuple[str, str]]:
    """Each page: (as it is, as the results write it)."""
    pages, seen = {}, []
    for path in PAGES:
        with open(path) as f:
            page = f.read()
        pages[path] = (page, render(page, seen))
    missing = [name for name in TABLES if name not in seen]
    if missing:
        raise KeyError(f"tables no page marks: {missing}")
    return pages


def unmarked_tables(page: str) -> list[str]:
    """Table lines outside the markers: copied in by hand."""
    return [line for line in MARKER.sub("", page).splitlines() if line.startswith("|")]


def disagreements() -> list[str]:
    """What is out of date: a diff per page that the results would change, and
    any table in docs/benchmarks.md outside the markers. Empty: all agree."""
    out = []
    for path, (page, new) in rendered().items():
        name = os.path.relpath(path, harness.ROOT)
        out.extend(difflib.unified_diff(page.splitlines(True), new.splitlines(True), name, f"{name}, rendered"))
        if path == PAGE:
            out.extend(f"a table outside the markers: {line}\n" for line in unmarked_tables(new))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is not up to date")
    args = parser.parse_args()
    if args.check:
        wrong = disagreements()
        sys.stdout.writelines(wrong)
        sys.exit(1 if wrong else 0)
    for path, (page, new) in rendered().items():
        if new != page:
            with open(path, "w") as f:
                f.write(new)
            print(f"wrote {os.path.relpath(path, harness.ROOT)}")
    for line in unmarked_tables(rendered()[PAGE][1]):
        print(f"a table outside the markers: {line}")


if __name__ == "__main__":
    main()
