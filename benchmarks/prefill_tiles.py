"""Prefill attention in query tiles against one masked call per chunk.

The torch attention reference (layers/backends/reference/attention.py) cuts a long
prefill chunk into query tiles that score only the keys they may read. This
script prefills the same prompts with the engine both ways, interleaved in
one process (these machines are noisy), and prints the best time of each.

    python -m benchmarks.prefill_tiles                  # tiny-gemma3 and small-gemma3
    python -m benchmarks.prefill_tiles --models gemma3-270m   # the real model: 16 prompts of 700 tokens
    python -m benchmarks.prefill_tiles --quick          # seconds: CI smoke run
"""

from __future__ import annotations

import time

from benchmarks import harness


def arguments(parser) -> None:
    parser.add_argument("--models", default="tiny-gemma3,small-gemma3")


def result_name(args) -> str:
    return "prefill_tiles.json" if args.models == "tiny-gemma3,small-gemma3" else \
        f"prefill_tiles_{args.models.replace(',', '_').replace('-', '_')}.json"


def run(args) -> dict:
    import hybridkv.layers.backends.reference.attention as attention
    from benchmarks import real_gemma3
    from benchmarks.engine_throughput import prompts_for
    from hybridkv import Engine, SamplingParams
    from hybridkv.tiny_models import tiny_model_dir

    models = ["tiny-gemma3"] if args.quick else args.models.split(",")
    num, repeat = (4, 1) if args.quick else (32, args.repeat)
    tiled = attention.query_tiles

    def one_call(spec, seg):
        return [(0, seg.length, 0, seg.mask.shape[-1])]

    print(f"{num} prompts of 100-1000 tokens (gemma3-270m: 16 of 700), prefill + 1 token, float32, "
          f"{args.threads} threads, best of {repeat}")
    print(f"{'model':<14} {'one call s':>11} {'query tiles s':>14} {'speedup':>8}")
    rows = []
    try:
        for model in models:
            if model == "gemma3-270m":  # the real model (the `gemma` extra), real_gemma3.py's long-16 prompts
                engine = Engine(real_gemma3.gguf_path(), kv_cache_memory="1GiB", progress=False, dtype="float32",
                                max_num_seqs=64, enable_prefix_caching=False)
                prompts = real_gemma3.batch_prompts(16, 700)
            else:
                engine = Engine(tiny_model_dir(model), kv_cache_memory="512MiB", progress=False, dtype="float32",
                                max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
                prompts = prompts_for("random", num, engine.vocab_size)
            params = SamplingParams(temperature=0.0, max_tokens=1)
            best = {"one": float("inf"), "tiles": float("inf")}
            for _ in range(repeat):
                for name, tiles in (("one", one_call), ("tiles", tiled)):
                    attention.query_tiles = tiles
                    start = time.perf_counter()
                    engine.generate(prompts, params, use_tqdm=False)
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"{model:<14} {best['one']:>11.2f} {best['tiles']:>14.2f} {best['one'] / best['tiles']:>7.2f}x")
            rows.append({"model": model, "prompts": len(prompts), "one_call_s": best["one"],
                         "query_tiles_s": best["tiles"], "speedup": best["one"] / best["tiles"]})
    finally:
        attention.query_tiles = tiled
    return {"models": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3, out=result_name)
