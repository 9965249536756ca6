"""Prefill of recurrent hybrids with a shared system prompt, this tree beside
other revisions: time to first token of 64 prompts sharing a 500-token
system prompt (prefix caching on: each hit needs the recurrent state at a
checkpoint), and the engine steps a lone 560-token prompt takes to its
first token (a prompt with a checkpoint inside: one step where states are
saved inside a prefill chunk, two where chunks stop at checkpoints).

Each revision runs in a git worktree of its own (its C kernels built
there), each measurement in a fresh process importing that tree's
hybridkv; the trees take turns within each round (`--repeat` rounds,
medians).

    python -m benchmarks.recurrent_prefill --baselines '85d8df1^,e5386fe'
    python -m benchmarks.recurrent_prefill --quick
"""

from __future__ import annotations

import random
import statistics

from benchmarks import harness


def measure(model: str, num_prompts: int, new_tokens: int, batch_tokens: int) -> dict:
    """One tree's run (in the tree's process: harness.call_in_tree)."""
    import time

    from hybridkv import Engine, SamplingParams
    from hybridkv.tiny_models import tiny_model_dir

    rng = random.Random(0)
    path = tiny_model_dir(model, dtype="float32")
    engine = Engine(path, kv_cache_memory="1GiB", dtype="float32", progress=False, max_num_seqs=num_prompts,
                    max_num_batched_tokens=batch_tokens)
    lone = [rng.randrange(5, 1000) for _ in range(560)]
    steps = engine.num_steps
    engine.generate([lone], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)  # (the warm-up too)
    lone_steps = engine.num_steps - steps
    engine.kv.reset_prefix_cache()
    system = [rng.randrange(5, 1000) for _ in range(500)]
    prompts = [system + [rng.randrange(5, 1000) for _ in range(rng.randint(20, 100))] for _ in range(num_prompts)]
    steps, start = engine.num_steps, time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    ttfts = sorted(o.metrics.ttft for o in outs)
    return {"ttft_mean": statistics.fmean(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "seconds": seconds, "steps": engine.num_steps - steps, "lone_prompt_steps": lone_steps,
            "hit_rate": engine.stats["prefix_hit_rate"], "block_size": engine.layout.block_size,
            "first_ids": outs[0].outputs[0].token_ids[:4]}


def arguments(parser) -> None:
    parser.add_argument("--models", default="tiny-qwen3-next,tiny-nemotron-h")
    parser.add_argument("--baselines", default="85d8df1^,e5386fe",
                        help="comma-separated git revisions measured beside this tree")


def run(args) -> dict:
    num_prompts, new_tokens, batch_tokens = (8, 4, 2048) if args.quick else (64, 16, 2048)
    models = ["tiny-qwen3-next"] if args.quick else args.models.split(",")
    trees = {"this tree": harness.ROOT}
    checkouts = []
    try:
        for revision in ([] if args.quick else [r for r in args.baselines.split(",") if r]):
            path, commit = harness.checkout(revision)
            checkouts.append(path)
            trees[f"{commit} ({revision})"] = path
        print(f"{num_prompts} prompts sharing a 500-token system prompt, {new_tokens} new tokens, float32, "
              f"{batch_tokens} tokens a step; medians of {args.repeat}")
        print(f"{'model':<16} {'code':<24} {'block':>5} {'TTFT mean':>10} {'TTFT p90':>9} {'hit rate':>9} "
              f"{'steps':>6} {'lone prompt steps':>18}")
        rows = []
        for model in models:
            runs = harness.interleaved(
                {code: (lambda tree=tree: harness.call_in_tree(tree, __file__, "measure",
                                                               [model, num_prompts, new_tokens, batch_tokens],
                                                               args.threads)) for code, tree in trees.items()},
                args.repeat)
            for code, measured in runs.items():
                row = dict(sorted(measured, key=lambda r: r["ttft_mean"])[(len(measured) - 1) // 2],
                           model=model, code=code, runs=measured)
                rows.append(row)
                print(f"{model:<16} {code:<24} {row['block_size']:>5} {1e3 * row['ttft_mean']:>8.0f}ms "
                      f"{1e3 * row['ttft_p90']:>7.0f}ms {row['hit_rate']:>9.1%} {row['steps']:>6} "
                      f"{row['lone_prompt_steps']:>18}")
    finally:
        for path in checkouts:
            harness.remove_checkout(path)
    return {"prefill": rows}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3)
