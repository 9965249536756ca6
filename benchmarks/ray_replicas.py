"""Two engine replicas on Ray Serve: time to first token and prefix-cache hit
rate with the hybrid router (serving/ray_router.py) against Ray Serve's
default router (power of two choices, which spreads requests like round
robin and knows nothing of the caches).

The workload: families of requests that share a long prefix (a document or
system prompt, as token ids) and differ in a short question; the requests of
all families are shuffled and sent by a few concurrent streaming clients.
Every configuration starts on fresh replicas (empty caches); the routers
alternate (hybrid, default, hybrid, ...) so that drift of the machine hits
both alike. TTFT is measured by the client (to the first streamed text);
the hit rate is the prompt tokens the replicas served from their caches
(usage.prompt_tokens_details.cached_tokens) over all prompt tokens.

    python -m benchmarks.ray_replicas                       # tiny Gemma-3 and Jamba, 2 rounds
    python -m benchmarks.ray_replicas --models gemma3-270m  # the real Gemma-3 270M (its package installed)
    python -m benchmarks.ray_replicas --quick
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time

import httpx
import ray
from ray import serve

from benchmarks import harness
from hybridkv.serving.ray import build_application, start_ray
from hybridkv.tiny_models import tiny_model_dir


def model_path(name: str) -> str:
    if name == "gemma3-270m":
        from hybridkv.demo import real_model_path

        path = real_model_path()
        if path is None:
            raise SystemExit("the real Gemma-3 270M is not installed (pip install -e '.[gemma]')")
        return path
    return tiny_model_dir(name)


def workload(seed: int, families: int, per_family: int, prefix_len: int, question_len: int, vocab: int):
    rng = random.Random(seed)
    requests = []
    for _ in range(families):
        prefix = [rng.randrange(10, vocab) for _ in range(prefix_len)]
        requests += [prefix + [rng.randrange(10, vocab) for _ in range(question_len)] for _ in range(per_family)]
    rng.shuffle(requests)
    return requests


def run_requests(base: str, app: str, prompts: list, clients: int, max_tokens: int) -> list[dict]:
    """Send `prompts` (token ids) over `clients` concurrent streaming clients:
    per prompt its TTFT, the mean gap between its later tokens, its prompt
    and cached tokens."""
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    out: list[dict] = [None] * len(prompts)

    def client():
        with httpx.Client(base_url=base, timeout=600) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    i, prompt = todo.pop(0)
                start = time.perf_counter()
                times, usage = [], None  # when each streamed text arrived
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                with http.stream("POST", f"/{app}/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            times.append(time.perf_counter())
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                gaps = [b - a for a, b in zip(times, times[1:])]
                out[i] = {"ttft": (times[0] if times else time.perf_counter()) - start,
                          "itl": statistics.fmean(gaps) if gaps else None,  # the mean gap between later tokens
                          "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arguments(parser) -> None:
    parser.add_argument("--models", default="tiny-gemma3,tiny-jamba")
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--per-family", type=int, default=6)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--stats-period", type=float, default=0.5, help="seconds between replica reports")


def run(args) -> dict:
    """`--repeat` runs per router, the routers alternating."""
    if args.quick:
        args.families, args.per_family = 4, 4

    start_ray(num_cpus=6, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    rows = []
    for model in args.models.split(","):
        path = model_path(model)
        options = dict(kv_cache_memory=args.kv_cache_memory, max_num_seqs=8, max_num_batched_tokens=512)
        vocab = 1000 if model.startswith("tiny") else 30000
        for round_ in range(args.repeat):
            for router in ("hybrid", "default") if round_ % 2 == 0 else ("default", "hybrid"):
                app = build_application(path, model_name=model, num_replicas=2, engine_options=options,
                                        router=router, stats_period_s=args.stats_period)
                serve.run(app, name="bench", route_prefix="/bench")
                prompts = workload(round_, args.families, args.per_family, args.prefix_len, args.question_len,
                                   vocab)
                run_requests(base, "bench", [[11, 12, 13]], 1, 1)  # warm-up: both routers' first call
                t0 = time.perf_counter()
                results = run_requests(base, "bench", prompts, args.clients, args.max_tokens)
                wall = time.perf_counter() - t0
                ttfts = sorted(r["ttft"] for r in results)
                row = {"model": model, "router": router, "round": round_, "requests": len(results),
                       "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
                       "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
                       "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
                       "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))], "wall_s": wall}
                rows.append(row)
                print(f"{model:12} {router:8} round {round_}: hit {100 * row['hit_rate']:5.1f}%  "
                      f"TTFT mean {row['ttft_mean_ms']:7.1f} ms", flush=True)
                serve.delete("bench")
    serve.shutdown()
    ray.shutdown()

    print(f"\n2 replicas, {args.families} families x {args.per_family} requests, prefix {args.prefix_len} + "
          f"question {args.question_len} tokens, {args.max_tokens} generated, {args.clients} clients, "
          f"{args.repeat} round(s) per router")
    print(f"{'model':12} {'router':8} {'hit rate':>9} {'TTFT mean':>10} {'p50':>8} {'p90':>8} {'wall':>7}")
    means = []
    for model in args.models.split(","):
        for router in ("hybrid", "default"):
            mine = [r for r in rows if r["model"] == model and r["router"] == router]
            row = {"model": model, "router": router, "rounds": len(mine),
                   **{key: statistics.fmean(r[key] for r in mine)
                      for key in ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "wall_s")}}
            means.append(row)
            print(f"{model:12} {router:8} {100 * row['hit_rate']:8.1f}% {row['ttft_mean_ms']:8.1f}ms "
                  f"{row['ttft_p50_ms']:6.1f}ms {row['ttft_p90_ms']:6.1f}ms {row['wall_s']:6.2f}s"
                  f"   (TTFT mean per round: {', '.join(format(r['ttft_mean_ms'], '.1f') for r in mine)})")
    return {"routers": means, "runs": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=2)
