"""Per-step times of the engine, CUDA graphs on and off, in one process:
decode-only steps (replayed graphs, or eager at fixed shapes) apart from
the steps that carry a prefill chunk (always eager). 64 prompts of 100-1,000
tokens, 32 new tokens each, on a Gemma-3-1B-shaped random model cut to 6
layers (one full-attention layer, five 512-token windows).

What it shows that a tokens/s figure hides: a step that is slow once (a
Triton kernel variant compiled on first use) against one that is slow every
time. The first engine in the process compiles; the one after it finds the
kernels in Triton's cache, so run it twice (--order) to tell the two apart.

    python -m benchmarks.step_times                      # CUDA: graphs, then eager
    python -m benchmarks.step_times --order eager,graphs
    python -m benchmarks.step_times --dry-run            # a tiny model on the CPU (checks the script)
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch

from benchmarks import harness
from benchmarks.engine_throughput import sync
from hybridkv import Engine, SamplingParams
from hybridkv.files import cache_root


def model_path(dry: bool) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    path = os.path.join(cache_root(), "models", f"gemma3-1b-shape-6-layers{'-dry' if dry else ''}-v1")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        sizes = (dict(vocab_size=1024, hidden_size=64, intermediate_size=128, head_dim=16) if dry else
                 dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912, head_dim=256))
        config = Gemma3TextConfig(**sizes, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                                  sliding_window=512, query_pre_attn_scalar=256, sliding_window_pattern=6,
                                  max_position_embeddings=32768)
        Gemma3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def step_times(path: str, device: str, eager: bool, prompts, new_tokens: int) -> dict:
    """{"decode": [seconds], "mixed": [seconds]} of one generate() over `prompts`."""
    engine = Engine(path, kv_cache_memory="4GiB", dtype="bfloat16" if device == "cuda" else "float32",
                    device=device, progress=False, max_num_seqs=64, max_num_batched_tokens=2048,
                    enforce_eager=eager, fixed_shape_decode=None if device == "cuda" else True)
    worker = engine.worker
    times = {"decode": [], "mixed": []}
    for method, kind in (("_decode", "decode"), ("_eager", "mixed")):
        run = getattr(worker, method)

        def timed(*args, run=run, kind=kind):
            sync(device)
            start = time.perf_counter()
            out = run(*args)
            sync(device)
            times[kind].append(time.perf_counter() - start)
            return out

        setattr(worker, method, timed)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    for kept in times.values():
        kept.clear()
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    times["wall"] = time.perf_counter() - start
    times["graphs"] = len(worker.graphs)
    times["backend"] = engine.backend.name
    return times


def arguments(parser) -> None:
    parser.add_argument("--order", default="graphs,eager", help="engines in the order they run (graphs, eager)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model on the CPU, decode at fixed shapes (--quick: the same, 4 new tokens)")


def run(args) -> dict | None:
    if args.quick:
        args.dry_run, args.new_tokens = True, 4
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("benchmarks/step_times.py needs CUDA (graphs); --dry-run checks the script on the CPU")
        return None
    path = model_path(args.dry_run)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(100, 1000))] for _ in range(64)]
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}; 64 prompts of 100-1000 tokens, {args.new_tokens} new tokens, 2048 tokens per step")
    print(f"{'engine':<8} {'backend':<8} {'graphs':>6} {'wall s':>7} {'step kind':<9} {'steps':>5} {'median ms':>10} "
          f"{'max ms':>9} {'sum s':>7}")
    rows = []
    for mode in args.order.split(","):
        times = step_times(path, device, mode == "eager", prompts, args.new_tokens)
        for kind in ("decode", "mixed"):
            if times[kind]:
                ms = [1e3 * t for t in times[kind]]
                row = {"device": name, "engine": mode, "backend": times["backend"], "graphs": times["graphs"],
                       "wall_s": times["wall"], "kind": kind, "steps": len(ms), "median_ms": statistics.median(ms),
                       "max_ms": max(ms), "sum_s": sum(ms) / 1e3}
                rows.append(row)
                print(f"{mode:<8} {row['backend']:<8} {row['graphs']:>6} {row['wall_s']:>7.2f} {kind:<9} "
                      f"{len(ms):>5} {row['median_ms']:>10.2f} {row['max_ms']:>9.1f} {row['sum_s']:>7.2f}")
    return {"steps": rows}


if __name__ == "__main__":
    harness.main(run, arguments)
