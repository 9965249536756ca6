"""Engine throughput and time to first token: hybridkv.Engine against
transformers' `generate` on the same random models, prompts, dtype and threads.

Workload 1: 64 prompts of 100-1,000 tokens, 128 new tokens each, greedy,
EOS ignored. transformers runs them as one batch with left padding and its
default dynamic cache (its TTFT is the time of the batched prefill, which
every request waits for). Workload 2: 64 prompts sharing a 500-token system
prompt, hybridkv with and without prefix caching (on the bigger models). Each measurement runs in
its own process, so peak RSS (model + cache + activations) is its own.

These machines are noisy (the same cell moves by 20% between runs), so each
comparison runs `--repeat` times as interleaved pairs (A, B, A, B, ...); the
tables show medians, and a ratio is the median of the per-pair ratios.

    python -m benchmarks.engine_throughput             # CPU, tiny and small models (and tiny gpt-oss)
    python -m benchmarks.engine_throughput --quick     # seconds: CI smoke run
    python -m benchmarks.engine_throughput --device cuda --dtype bfloat16   # GPU, 1B shapes
    python -m benchmarks.engine_throughput --device cuda --graphs both      # and with CUDA graphs off
    python -m benchmarks.engine_throughput --dry-run --repeat 1   # the GPU cases, shrunk, on the CPU
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import time

from benchmarks import harness

# GPU workloads: real layer counts, heads, windows and vocabularies, random weights.
GPU_MODELS = {
    "gemma3-1b-shape": ("gemma3", dict(vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                                       head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                                       sliding_window_pattern=6, max_position_embeddings=32768)),
    "jamba-1b-shape": ("jamba", dict(vocab_size=65536, hidden_size=2048, intermediate_size=5632,
                                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                                     attn_layer_period=8, attn_layer_offset=4, num_experts=1,
                                     mamba_d_state=16, mamba_dt_rank=128, max_position_embeddings=32768)),
}


# --dry-run: the same families and layer patterns, a few small layers.
DRY_SIZES = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=None, head_dim=16,
                 mamba_dt_rank=8)


def left_padded(prompts: list[list[int]]):
    """(input ids, attention mask) for transformers' batched generate:
    prompts padded on the left with 0 to the longest."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def gpu_model(name: str, dry: bool) -> tuple[str, dict]:
    family, sizes = GPU_MODELS[name]
    if not dry:
        return family, sizes
    sizes = dict(sizes, **{k: v for k, v in DRY_SIZES.items() if v is not None and k in sizes})
    sizes["num_hidden_layers"] = 6 if family == "gemma3" else 8
    return family, sizes


def prompts_for(kind: str, n: int, vocab: int, seed: int = 0, low=100, high=1000):
    rng = random.Random(seed)
    if kind == "shared":
        system = [rng.randrange(5, vocab) for _ in range(500)]
        return [system + [rng.randrange(5, vocab) for _ in range(rng.randint(20, 100))] for _ in range(n)]
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def model_path(name: str, dry: bool = False) -> str:
    """The folder of model `name`, one per model whatever the run's dtype:
    both engines cast the saved weights to their dtype at load."""
    from hybridkv.files import cache_root
    from hybridkv.tiny_models import MODELS, tiny_model_dir

    if name in MODELS:
        return tiny_model_dir(name, dtype="float32")
    family, sizes = gpu_model(name, dry)
    path = os.path.join(cache_root(), "models", f"{name}-{'dry-' if dry else ''}v1")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig, JambaConfig, JambaForCausalLM

        torch.manual_seed(0)
        if family == "gemma3":
            model = Gemma3ForCausalLM(Gemma3TextConfig(**sizes))
        else:
            model = JambaForCausalLM(JambaConfig(**sizes, mamba_d_conv=4, mamba_expand=2))
        model.to(torch.bfloat16).save_pretrained(path)
    return path


# -- workers (run in their own process) -----------------------------------------------

def run_hybridkv(args) -> dict:
    import torch

    from hybridkv import Engine, SamplingParams
    from hybridkv.core.layout import parse_memory

    from hybridkv.core import plan_layout
    from hybridkv.core.hf_config import load_config, specs_from_config

    torch.set_num_threads(args["threads"])
    dry = args.get("dry", False)
    path = model_path(args["model"], dry)
    config = load_config(path)
    prompts = prompts_for(args["workload"], args["num_prompts"], config["vocab_size"])
    longest = max(len(p) for p in prompts) + args["max_tokens"]
    layout = plan_layout(specs_from_config(config, dtype=args["dtype"]), 1 << 30)  # the page size and rules
    pages = len(prompts) * layout.pages_per_request(longest, chunk=2048) + 64
    budget = max(parse_memory("16MiB"), pages * layout.page_size_bytes)
    engine = Engine(path, kv_cache_memory=budget, dtype=args["dtype"], device=args["device"], progress=False,
                    max_num_seqs=max(64, len(prompts)), max_num_batched_tokens=args["batch_tokens"],
                    enable_prefix_caching=args["prefix_caching"], enforce_eager=not args.get("graphs", True),
                    fixed_shape_decode=True if dry else None, backend=args.get("backend"))
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    engine.kv.reset_prefix_cache()
    sync(args["device"])
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    sync(args["device"])
    elapsed = time.perf_counter() - start
    ttfts = sorted(o.metrics.ttft for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "ttft_mean": statistics.mean(ttfts),
            "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))], "steps": engine.num_steps,
            "hit_rate": engine.stats["prefix_hit_rate"], "preemptions": engine.stats["preemptions"],
            "backend": engine.backend.name, "cuda_graphs": len(engine.worker.graphs)}


def run_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridkv.layers.dtypes import TORCH_DTYPES

    torch.set_num_threads(args["threads"])
    path = model_path(args["model"], args.get("dry", False))
    dtype = TORCH_DTYPES[args["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args["device"]).eval()
    prompts = prompts_for(args["workload"], args["num_prompts"], model.config.vocab_size)
    ids, mask = left_padded(prompts)
    ids, mask = ids.to(args["device"]), mask.to(args["device"])

    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """Notes when generate() hands out the batch's first new tokens: the
        TTFT of every request (it waits for the batched prefill)."""

        def __init__(self):
            self.calls, self.time = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt itself
                sync(args["device"])
                self.time = time.perf_counter()

        def end(self):
            pass

    with torch.no_grad():
        model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2,
                       do_sample=False, pad_token_id=0)  # warm-up
    first = FirstToken()
    sync(args["device"])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args["max_tokens"],
                             min_new_tokens=args["max_tokens"], do_sample=False, pad_token_id=0, streamer=first)
    sync(args["device"])
    elapsed = time.perf_counter() - start
    ttft = first.time - start
    generated = (out.shape[1] - ids.shape[1]) * len(prompts)
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "ttft_mean": ttft, "ttft_p90": ttft}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def worker(spec: str) -> None:
    args = json.loads(spec)
    result = (run_hybridkv if args["engine"] == "hybridkv" else run_transformers)(args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args["device"].startswith("cuda"):
        import torch

        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def measure(tree: str | None = None, **args) -> dict:
    """One measurement in its own process; `tree`: another checkout of
    hybridkv whose own copy of this module (and package) runs it (A/B runs)."""
    root = os.path.abspath(tree) if tree else harness.ROOT
    proc = subprocess.run([sys.executable, "-m", "benchmarks.engine_throughput", "--worker", json.dumps(args)],
                          capture_output=True, text=True, cwd=root, env=harness.with_pythonpath(root))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed ({args['engine']} {args['model']}):\n{proc.stderr[-3000:]}")


def pairs(repeat: int, *specs: dict, warm: int = 0) -> tuple[list[dict], ...]:
    """`repeat` runs of each spec, interleaved so that all see the same noise;
    first `warm` untimed runs of each hybridkv spec: on a GPU the first
    process compiles Triton's kernel variants (seconds each) into its disk
    cache and the later ones load them, so without a warm run the first
    engine measured pays what the others do not."""
    for spec in specs:
        if spec["engine"] == "hybridkv":
            for _ in range(warm):
                measure(**spec)
    runs = harness.interleaved({i: lambda spec=spec: measure(**spec) for i, spec in enumerate(specs)}, repeat)
    return tuple(runs[i] for i in range(len(specs)))


def median_run(runs: list[dict], key: str = "tokens_per_s") -> dict:
    """The run with the median `key` (lower median for an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def weight_elements(model: str, dry: bool = False, keep=lambda key: True) -> int:
    """Elements of the model's saved weights (those whose name `keep` takes)."""
    from safetensors import safe_open

    path = model_path(model, dry)
    total = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys() if keep(key))
    return total


def weight_bound(model: str, batch: int, bandwidth: float = 3.0e12, dry: bool = False) -> float:
    """Decode tokens/s if each step only had to read the weights once (bf16)."""
    return batch * bandwidth / (2 * weight_elements(model, dry))


def arguments(parser) -> None:
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="hybridkv's token budget per step (max_num_batched_tokens); the engine's default is 1024")
    parser.add_argument("--only", choices=["throughput", "shared"], default=None,
                        help="run one of the two workloads (the JSON then holds only that one)")
    parser.add_argument("--models", default=None, help="comma-separated model names")
    parser.add_argument("--graphs", choices=["on", "off", "both"], default="on",
                        help="CUDA graphs for hybridkv's decode steps (both: a row each; CUDA only)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated kernel backends for hybridkv's rows (e.g. auto,flashinfer; default: "
                             "the engine's choice); a backend whose steps are eager gets no graphs row")
    parser.add_argument("--warm-runs", type=int, default=None,
                        help="untimed runs of each hybridkv case first (default: 1 on CUDA, where they fill "
                             "Triton's kernel cache; 0 on the CPU)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts of the batch workload (default 64)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 128)")
    parser.add_argument("--baseline", default=None, metavar="TREE",
                        help="another checkout of hybridkv (e.g. a git worktree of an older commit): its engine "
                             "runs beside this one, interleaved, as 'hybridkv (base)'")
    parser.add_argument("--no-transformers", action="store_true",
                        help="hybridkv's rows alone (no transformers row and no speedup): a GPU run short of time "
                             "reads its rows against the weights-read bound")
    parser.add_argument("--dry-run", action="store_true",
                        help="the GPU models shrunk to a few small layers, on the CPU, decode at fixed shapes: "
                             "checks every case of a GPU run without a GPU")


def run(args) -> dict:
    """Each comparison `--repeat` times, interleaved: the median run and the
    median of the per-pair ratios."""
    gpu = args.device.startswith("cuda") or args.dry_run
    if args.dry_run:
        args.device = "cpu"
    dtype = args.dtype or ("bfloat16" if gpu and not args.dry_run else "float32")
    if args.models:
        models = args.models.split(",")
    elif args.quick:
        models = ["tiny-gemma3"]
    else:
        models = list(GPU_MODELS) if gpu else ["tiny-gemma3", "small-gemma3", "tiny-jamba", "small-jamba",
                                               "tiny-gpt-oss", "tiny-qwen3-next"]
    n, new = (8, 16) if args.quick else (4, 8) if args.dry_run else (64, 128)
    n, new = args.num_prompts or n, args.new_tokens or new
    batches = [n] + ([1] if gpu and not args.quick else [])
    common = dict(device=args.device, dtype=dtype, threads=args.threads, max_tokens=new,
                  batch_tokens=args.batch_tokens,
                  dry=args.dry_run)
    # (On the CPU, dry runs included, there are no graphs: one hybridkv row.)
    graph_modes = ([True] if args.device == "cpu" else
                   {"on": [True], "off": [False], "both": [True, False]}[args.graphs])
    # (backend, graphs) per hybridkv row; FlashInfer's steps are eager (layers/backends/flashinfer).
    modes = [(backend, graphs) for backend in (args.backends.split(",") if args.backends else [None])
             for graphs in graph_modes if not (graphs and backend == "flashinfer" and args.device != "cpu")]
    rows = []
    print(f"device {args.device}, {dtype}, {args.threads} threads; {n} prompts of 100-1000 tokens, {new} new tokens; "
          f"hybridkv budget {args.batch_tokens} tokens per step")
    print(f"{'model':<16} {'batch':>5} {'engine':<13} {'tok/s':>9} {'TTFT mean':>10} {'TTFT p90':>9} "
          f"{'peak RSS MiB':>13} {'speedup':>8}")
    repeat = args.repeat
    warm = args.warm_runs if args.warm_runs is not None else int(args.device.startswith("cuda"))
    for model in models if args.only != "shared" else []:
        for batch in batches:
            base_spec = dict(engine="transformers", model=model, workload="random", num_prompts=batch, **common)
            row = {"model": model, "batch": batch, "device": args.device, "dtype": dtype,
                   "batch_tokens": args.batch_tokens}
            for backend, graphs in modes:
                label = "hybridkv" if backend in (None, "auto") else backend
                name = label if len(modes) == 1 else f"{label} ({'graphs' if graphs else 'eager'})"
                ours_spec = dict(engine="hybridkv", model=model, workload="random", num_prompts=batch,
                                 prefix_caching=True, graphs=graphs, backend=backend, **common)
                peers = [] if args.no_transformers else [base_spec]
                specs = peers + [ours_spec] + ([dict(ours_spec, tree=args.baseline)] if args.baseline else [])
                runs = dict(zip(["transformers"] * len(peers) + ["ours", "base"], pairs(repeat, *specs, warm=warm)))
                if peers and "transformers" not in row:
                    row["transformers"] = median_run(runs["transformers"])
                    base = row["transformers"]
                    print(f"{model:<16} {batch:>5} {'transformers':<13} {base['tokens_per_s']:>9.1f} "
                          f"{base['ttft_mean']:>9.3f}s {base['ttft_p90']:>8.3f}s {base['peak_rss_mib']:>13.0f} "
                          f"{1.0:>7.2f}x")
                row.setdefault("runs", {})
                if peers:
                    row["runs"]["transformers"] = runs["transformers"]

                def over_transformers(label):
                    if not peers:
                        return None
                    return statistics.median(b["tokens_per_s"] / a["tokens_per_s"]
                                             for a, b in zip(runs["transformers"], runs[label]))

                def times(speedup):
                    return f"{speedup:>7.2f}x" if speedup is not None else f"{'-':>8}"

                if args.baseline:
                    old = median_run(runs["base"])
                    speedup = over_transformers("base")
                    print(f"{model:<16} {batch:>5} {'hybridkv base':<13} {old['tokens_per_s']:>9.1f} "
                          f"{old['ttft_mean']:>9.3f}s {old['ttft_p90']:>8.3f}s {old['peak_rss_mib']:>13.0f} "
                          f"{times(speedup)}")
                    row["hybridkv_base"], row["speedup_base"] = old, speedup
                    row["runs"]["hybridkv_base"] = runs["base"]
                    row["vs_base"] = statistics.median(b["tokens_per_s"] / a["tokens_per_s"]
                                                       for a, b in zip(runs["base"], runs["ours"]))
                ours = median_run(runs["ours"])
                speedup = over_transformers("ours")
                vs = f"  ({row['vs_base']:.2f}x base)" if args.baseline else ""
                print(f"{model:<16} {batch:>5} {name:<13} {ours['tokens_per_s']:>9.1f} {ours['ttft_mean']:>9.3f}s "
                      f"{ours['ttft_p90']:>8.3f}s {ours['peak_rss_mib']:>13.0f} {times(speedup)}{vs}")
                key = label if graphs else f"{label}_eager"  # hybridkv, hybridkv_eager, flashinfer_eager
                row[key], row["speedup" if key == "hybridkv" else f"speedup_{key}"] = ours, speedup
                row["runs"][key] = runs["ours"]
            if gpu:
                row["weight_bound_tokens_per_s"] = weight_bound(model, batch, dry=args.dry_run)
                print(f"{'':<16} {'':>5} {'weights bound':<13} {row['weight_bound_tokens_per_s']:>9.0f}"
                      f"   (weights bytes / 3.0 TB/s per step)")
            rows.append(row)
    shared = []
    shared_models = [m for m in models if not m.startswith("tiny-")] or models  # the bigger ones: prefill matters
    if args.only != "throughput" and not gpu:
        print(f"\nshared 500-token system prompt, {n} prompts: TTFT with and without prefix caching")
        print(f"{'model':<16} {'TTFT off':>9} {'TTFT on':>9} {'gain':>6} {'hit rate':>9}")
    for model in shared_models if args.only != "throughput" and not gpu else []:
        spec = dict(engine="hybridkv", model=model, workload="shared", num_prompts=n, **common)
        runs = pairs(repeat, dict(spec, prefix_caching=False), dict(spec, prefix_caching=True))
        off, on = median_run(runs[0], "ttft_mean"), median_run(runs[1], "ttft_mean")
        gain = statistics.median(a["ttft_mean"] / b["ttft_mean"] for a, b in zip(*runs))
        print(f"{model:<16} {off['ttft_mean']:>8.3f}s {on['ttft_mean']:>8.3f}s {gain:>5.1f}x {on['hit_rate']:>9.1%}")
        shared.append({"model": model, "prompts": n, "batch_tokens": args.batch_tokens, "off": off, "on": on,
                       "ttft_gain": gain, "runs": {"off": runs[0], "on": runs[1]}})
    return {"throughput": rows, "shared_prefix": shared}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # one measurement, in a process of its own (measure())
        worker(sys.argv[2])
    else:
        harness.main(run, arguments, repeat=3)
