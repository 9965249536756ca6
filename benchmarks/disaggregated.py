"""Prefill and decode replicas against ordinary ones, on Ray Serve: time to
first token, the time between tokens, and what the transfer costs.

Two configurations of two engine replicas, alternating round by round on
fresh replicas: "2 replicas" (each computes its prompts and decodes them,
the hybrid router) and "1 prefill + 1 decode" (`prefill_replicas=1`: the
prefill replica computes each prompt and leaves the blocks a hit of it
reads in a directory under /dev/shm; the decode replica loads them and
decodes; a prompt of at most `local_prefill_tokens`, 64, past the decode
replica's hit is computed there, no transfer). The load mixes long prompts with short ones, every answer long,
sent by concurrent streaming clients; prompts share nothing. Measured by
the client: TTFT (to the first streamed text) and the mean gap between a
request's later tokens (ITL). Then the transfer alone, from the layout and
the storage: the bytes a prompt ships (`KVCacheLayout.hit_bytes`, what the
engine ships block for block) against every layer's cache, and the time to
write and read them through the disk tier in /dev/shm.

    python -m benchmarks.disaggregated                      # the real Gemma-3 270M (its package installed)
    python -m benchmarks.disaggregated --model tiny-gemma3
    python -m benchmarks.disaggregated --quick              # CI: tiny Gemma-3, a few requests
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time

import ray
from ray import serve

from benchmarks import harness
from benchmarks.ray_replicas import free_port, model_path, run_requests
from hybridkv.serving.ray import build_application, start_ray


def workload(seed: int, requests: int, long_len: int, short_len: int, vocab: int) -> list[list[int]]:
    """Prompts that share nothing, long and short alternating."""
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(long_len if i % 2 == 0 else short_len)]
            for i in range(requests)]


def transfer_cost(path: str, kv_cache_memory: str, prompt_len: int, directory: str) -> dict:
    """What one prompt of `prompt_len` tokens ships, and the time to write
    it to the disk tier in `directory` and read it back (a fresh store)."""
    import torch

    from hybridkv.core.dtypes import dtype_name
    from hybridkv.core.hf_config import specs_from_config
    from hybridkv.core.layout import plan_layout
    from hybridkv.layers.dtypes import choose_dtype
    from hybridkv.modeling.loader import checkpoint_dtype, read_config, resolve_model_dir
    from hybridkv.tiers import TierStore

    config = read_config(resolve_model_dir(path, progress=False))[1]
    dtype, _ = choose_dtype(None, torch.device("cpu"), checkpoint_dtype(config))  # the replicas' own choice
    layout = plan_layout(specs_from_config(config.to_dict(), dtype=dtype_name(dtype)), kv_cache_memory)
    hit = (prompt_len - 1) // layout.block_size * layout.block_size
    shipped, everything = layout.hit_bytes(hit), layout.all_layers_bytes(hit)
    pages = shipped // layout.page_size_bytes
    store = TierStore(layout.page_size_bytes, 1, disk_dir=directory, disk_bytes=4 * shipped + (1 << 20),
                      identity=bytes(32))
    blocks = [(i.to_bytes(32, "little"), torch.randint(0, 255, (1, layout.page_size_bytes), dtype=torch.uint8))
              for i in range(pages)]
    t0 = time.perf_counter()
    for key, content in blocks:
        store.write_disk(0, key, content)
    t1 = time.perf_counter()
    for key, _ in blocks:
        assert store.read(0, key) is not None
    t2 = time.perf_counter()
    return {"prompt_tokens": prompt_len, "hit_tokens": hit, "bytes": shipped, "all_layers_bytes": everything,
            "write_ms": 1e3 * (t1 - t0), "read_ms": 1e3 * (t2 - t1)}


def arguments(parser) -> None:
    parser.add_argument("--model", default="gemma3-270m", help="gemma3-270m (the real model) or a tiny one")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--long", type=int, default=1024, help="tokens of a long prompt")
    parser.add_argument("--short", type=int, default=64, help="tokens of a short prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of every answer")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="256MiB")


def run(args) -> dict:
    """`--repeat` rounds, the configurations alternating."""
    if args.quick:
        args.model, args.requests, args.long, args.short, args.max_tokens = "tiny-gemma3", 6, 256, 32, 8
    path = model_path(args.model)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    start_ray(num_cpus=6, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    options = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=8, max_num_batched_tokens=512)
    vocab = 1000 if args.model.startswith("tiny") else 30000
    rows = []
    for round_ in range(args.repeat):
        for config in ("2 replicas", "1 prefill + 1 decode")[::1 if round_ % 2 == 0 else -1]:
            directory = tempfile.mkdtemp(prefix="hybridkv-pd-", dir=shm)
            try:
                if config == "2 replicas":
                    app = build_application(path, model_name=args.model, num_replicas=2, engine_options=options)
                else:
                    app = build_application(path, model_name=args.model, num_replicas=1, prefill_replicas=1,
                                            engine_options=dict(options, kv_disk_cache=directory))
                serve.run(app, name="bench", route_prefix="/bench")
                run_requests(base, "bench", [[11, 12, 13]], 1, 2)  # warm-up: the first call's set-up
                t0 = time.perf_counter()
                results = run_requests(base, "bench", workload(round_, args.requests, args.long, args.short, vocab),
                                       args.clients, args.max_tokens)
                wall = time.perf_counter() - t0
                serve.delete("bench")
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            ttfts = sorted(r["ttft"] for r in results)
            itls = sorted(r["itl"] for r in results if r["itl"] is not None)
            row = {"config": config, "round": round_, "requests": len(results),
                   "ttft_mean_ms": 1e3 * statistics.fmean(ttfts), "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
                   "itl_mean_ms": 1e3 * statistics.fmean(itls), "itl_p90_ms": 1e3 * itls[int(0.9 * (len(itls) - 1))],
                   "cached_fraction": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
                   "output_tok_per_s": len(results) * args.max_tokens / wall, "wall_s": wall}
            rows.append(row)
            print(f"{config:22} round {round_}: TTFT {row['ttft_mean_ms']:7.1f} ms (p90 {row['ttft_p90_ms']:7.1f}), "
                  f"ITL {row['itl_mean_ms']:6.1f} ms (p90 {row['itl_p90_ms']:6.1f}), cached "
                  f"{100 * row['cached_fraction']:4.1f}%, {row['output_tok_per_s']:6.1f} tok/s", flush=True)
    serve.shutdown()
    ray.shutdown()
    keys = ("ttft_mean_ms", "ttft_p90_ms", "itl_mean_ms", "itl_p90_ms", "cached_fraction", "output_tok_per_s")
    configs = [{"config": c, "model": args.model, "rounds": args.repeat,
                **{k: statistics.median(r[k] for r in rows if r["config"] == c) for k in keys}}
               for c in ("2 replicas", "1 prefill + 1 decode")]
    directory = tempfile.mkdtemp(prefix="hybridkv-pd-", dir=shm)
    try:
        transfer = [transfer_cost(path, args.kv_cache_memory, n, directory) for n in sorted({args.short, args.long})]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{args.requests} requests (prompts of {args.long} and {args.short} tokens alternating), "
          f"{args.max_tokens} tokens each, {args.clients} clients; medians of {args.repeat} round(s)")
    for c in configs:
        print(f"{c['config']:22} TTFT {c['ttft_mean_ms']:7.1f} ms (p90 {c['ttft_p90_ms']:7.1f})  ITL "
              f"{c['itl_mean_ms']:6.1f} ms (p90 {c['itl_p90_ms']:6.1f})  {c['output_tok_per_s']:6.1f} tok/s")
    for t in transfer:
        print(f"a {t['prompt_tokens']}-token prompt ships {t['bytes'] / 2**20:.2f} MiB "
              f"({100 * t['bytes'] / t['all_layers_bytes']:.0f}% of every layer's), written in {t['write_ms']:.2f} ms "
              f"and read in {t['read_ms']:.2f} ms under {shm or 'a temporary directory'}")
    return {"configs": configs, "runs": rows, "transfer": transfer}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=2)
