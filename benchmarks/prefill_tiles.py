"""Prefill attention in query tiles against one masked call per chunk, the
tiles' softmax in one C pass against torch's passes, and (bfloat16 on a
CPU with AMX) the C kernel on the tile unit against the tiles.

The torch attention reference (layers/backends/reference/attention.py) cuts a long
prefill chunk into query tiles that score only the keys they may read; on
the cpu backend each tile's softmax is one pass of a C kernel
(`masked_softmax`) where torch makes four, and in bfloat16 where the CPU
has AMX every chunk of a layer is one call of `prefill_attention`
(kernels.c). This script prefills the same prompts with the engine each
way, interleaved in one process (these machines are noisy), and prints the
best time of each.

    python -m benchmarks.prefill_tiles                  # tiny-gemma3 and small-gemma3
    python -m benchmarks.prefill_tiles --models gemma3-270m   # the real model: 16 prompts of 700 tokens
    python -m benchmarks.prefill_tiles --models gemma3-270m --dtype bfloat16
    python -m benchmarks.prefill_tiles --quick          # seconds: CI smoke run
"""

from __future__ import annotations

import time

from benchmarks import harness


def arguments(parser) -> None:
    parser.add_argument("--models", default="tiny-gemma3,small-gemma3")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def result_name(args) -> str:
    name = "prefill_tiles" if args.models == "tiny-gemma3,small-gemma3" else \
        f"prefill_tiles_{args.models.replace(',', '_').replace('-', '_')}"
    return f"{name}.json" if args.dtype == "float32" else f"{name}_{args.dtype}.json"


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

    print(f"{num} prompts of 100-1000 tokens (gemma3-270m: 16 of 700), prefill + 1 token, {args.dtype}, "
          f"{args.threads} threads, best of {repeat}")
    print(f"{'model':<14} {'one call s':>11} {'tiles, torch softmax s':>23} {'query tiles s':>14} "
          f"{'tiles x':>8} {'C softmax x':>12} {'AMX kernel s':>13} {'AMX x':>6}")
    # (name, tiles, C softmax, AMX kernel)
    configs = (("one", one_call, True, False), ("torch softmax", tiled, False, False), ("tiles", tiled, True, False),
               ("amx", tiled, True, True))
    rows = []
    try:
        for model in models:
            if model == "gemma3-270m":  # the real model (the `gemma` extra), real_gemma3.py's long-16 prompts
                engine = Engine(real_gemma3.gguf_path(), kv_cache_memory="1GiB", progress=False, dtype=args.dtype,
                                max_num_seqs=64, enable_prefix_caching=False)
                prompts = real_gemma3.batch_prompts(16, 700)
            else:
                engine = Engine(tiny_model_dir(model), kv_cache_memory="512MiB", progress=False, dtype=args.dtype,
                                max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
                prompts = prompts_for("random", num, engine.vocab_size)
            ops = engine.backend.attention
            fused = getattr(ops, "fused_softmax", None)  # the cpu backend's switches (None: another backend)
            amx = fused is not None and args.dtype == "bfloat16" and ops.lib.amx_prefill_attention
            params = SamplingParams(temperature=0.0, max_tokens=1)
            if amx:  # a first run says whether the kernel takes this model (heads a multiple of 32 wide)
                calls = ops.amx_prefill_calls
                engine.generate(prompts[:1], params, use_tqdm=False)
                amx = ops.amx_prefill_calls > calls
            runs = [c for c in configs if amx or not c[3]]
            best = {c[0]: float("inf") for c in runs}
            for round_ in range(repeat):
                # Reversed every other round: a fixed order lets this VM's drift favour one.
                for name, tiles, c_softmax, on_tiles in runs if round_ % 2 == 0 else runs[::-1]:
                    attention.query_tiles = tiles
                    if fused is not None:
                        ops.fused_softmax, ops.amx_prefill = c_softmax, on_tiles
                    calls = getattr(ops, "amx_prefill_calls", 0)
                    start = time.perf_counter()
                    engine.generate(prompts, params, use_tqdm=False)
                    best[name] = min(best[name], time.perf_counter() - start)
                    if (getattr(ops, "amx_prefill_calls", 0) > calls) != on_tiles:
                        raise RuntimeError(f"{model}: the {name!r} runs {'did not take' if on_tiles else 'took'} "
                                           f"the AMX kernel")
            if fused is not None:
                ops.fused_softmax, ops.amx_prefill = fused, True
            one, torch_softmax, tiles = best["one"], best["torch softmax"], best["tiles"]
            row = {"model": model, "prompts": len(prompts), "dtype": args.dtype, "backend": engine.backend.name,
                   "one_call_s": one, "torch_softmax_s": torch_softmax, "query_tiles_s": tiles,
                   "speedup": one / tiles, "c_softmax_speedup": torch_softmax / tiles}
            if amx:
                row.update(amx_s=best["amx"], amx_speedup=tiles / best["amx"])
            print(f"{model:<14} {one:>11.2f} {torch_softmax:>23.2f} {tiles:>14.2f} {one / tiles:>7.2f}x "
                  f"{torch_softmax / tiles:>11.2f}x " +
                  (f"{best['amx']:>13.2f} {tiles / best['amx']:>5.2f}x" if amx else f"{'not run':>13}"))
            rows.append(row)
    finally:
        attention.query_tiles = tiled
    return {"models": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3, out=result_name)
