"""Where a step's time goes on a GPU: the engine's decode steps under
torch.profiler, CUDA graphs on and off, at batch 1 and 64, beside the
weights-read bound of a step; and its prefill steps (mode "prefill": each
step one new request's prompt of `--prefill-tokens` tokens, eager, as
every step with a prompt chunk runs), beside the time the step's matrix
products would take at the GPU's dense bf16 rate.

Per case: the wall time of a decode step (20 steps, synchronised), the GPU
time its kernels add up to, how many kernels it launches, and the kernels
that take the most time. The gap between wall and kernel time is launch
and host overhead (what graphs remove); the gap between kernel time and the
bound is the kernels themselves.

Model: the Gemma-3-1B shape of benchmarks/engine_throughput.py (random
weights, bf16); each request has a 500-token prompt and is profiled once
every request decodes.

    python -m benchmarks.gpu_profile                 # CUDA: ~2 minutes
    python -m benchmarks.gpu_profile --batches 1 --modes graphs
    python -m benchmarks.gpu_profile --modes prefill --prefill-tokens 2048
    python -m benchmarks.gpu_profile --dry-run       # a tiny model on the CPU (checks the script)
"""

from __future__ import annotations

import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.engine_throughput import model_path, sync, weight_bound, weight_elements
from hybridkv import Engine, SamplingParams

MODEL = "gemma3-1b-shape"


def decoding_engine(path: str, device: str, dry: bool, batch: int, eager: bool) -> Engine:
    """An engine whose `batch` requests have all finished their prefill."""
    engine = Engine(path, kv_cache_memory="4GiB", dtype="float32" if dry else "bfloat16", device=device,
                    progress=False, max_num_seqs=64, max_num_batched_tokens=2048, enforce_eager=eager,
                    fixed_shape_decode=True if dry else None)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(batch):
        engine.add_request([rng.randrange(5, 1000) for _ in range(500)], params, request_id=f"r{i}")
    decoding = set()
    while len(decoding) < batch:  # every prompt prefilled
        decoding.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)
    for _ in range(5):  # and a few decode steps
        engine.step()
    return engine


def prefilling_engine(path: str, device: str, dry: bool, tokens: int, requests: int) -> Engine:
    """An engine holding `requests` prompts of `tokens` tokens, one token
    each: every step prefills one whole prompt (the batch budget is one
    prompt) and finishes its request."""
    engine = Engine(path, kv_cache_memory="4GiB", dtype="float32" if dry else "bfloat16", device=device,
                    progress=False, max_num_seqs=64, max_num_batched_tokens=tokens, enforce_eager=True)
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(requests):
        engine.add_request([rng.randrange(5, 1000) for _ in range(tokens)], params, request_id=f"p{i}")
    return engine


def matmul_params(model: str, dry: bool) -> int:
    """Weights a prompt token multiplies by: all but the embedding table
    (a lookup; the tied LM head runs for the one sampled row only)."""
    return weight_elements(model, dry, keep=lambda key: "embed" not in key)


def kernel_rows(prof, steps: int, device: str) -> tuple[float, float, list[dict]]:
    """(device µs per step, launches per step, top kernels) from a profile."""
    rows = []
    for event in prof.key_averages():
        if device == "cuda":
            self_us = getattr(event, "self_device_time_total", None)
            if self_us is None:
                self_us = event.self_cuda_time_total
            if event.device_type != torch.autograd.DeviceType.CUDA or self_us <= 0:
                continue
        else:
            self_us = event.self_cpu_time_total
            if self_us <= 0 or event.key.startswith("ProfilerStep"):
                continue
        rows.append(dict(name=event.key, calls=event.count / steps, us=self_us / steps))
    rows.sort(key=lambda r: -r["us"])
    return sum(r["us"] for r in rows), sum(r["calls"] for r in rows), rows


def profile_case(path: str, device: str, dry: bool, batch: int, mode: str, steps: int,
                 prefill_tokens: int = 2048) -> dict:
    if mode == "prefill":
        engine = prefilling_engine(path, device, dry, prefill_tokens, requests=2 * steps + 2)
        for _ in range(2):  # kernels compiled, allocations settled
            engine.step()
    else:
        engine = decoding_engine(path, device, dry, batch, eager=mode == "eager")
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    kernel_us, launches, rows = kernel_rows(prof, steps, device)
    return dict(batch=batch, mode=mode, step_ms=1e3 * statistics.median(times), kernel_ms=kernel_us / 1e3,
                launches=launches, graphs=len(engine.worker.graphs), top=rows[:15],
                tokens_per_step=prefill_tokens if mode == "prefill" else batch)


def arguments(parser) -> None:
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--modes", default="graphs,eager,prefill",
                        help="decode steps with CUDA graphs / eager, and prefill steps")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="tokens a prefill step computes (default 2048; 64 in a dry run)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="the model shrunk, on the CPU (--quick: the same)")


def run(args) -> dict | None:
    args.dry_run |= args.quick
    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        print("benchmarks/gpu_profile.py needs CUDA; --dry-run checks the script on the CPU")
        return None
    path = model_path(MODEL, dry=args.dry_run)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    prefill_tokens = args.prefill_tokens or (64 if args.dry_run else 2048)
    modes = args.modes.split(",")
    cases = [(int(b), m) for b in args.batches.split(",") for m in modes if m != "prefill"]
    cases += [(1, "prefill")] if "prefill" in modes else []
    results = []
    for batch, mode in cases:
        case = profile_case(path, device, args.dry_run, batch, mode, args.steps, prefill_tokens)
        if mode == "prefill":
            # Its matrix products at the dense bf16 rate (H100 SXM: 989 TFLOP/s; CPU: not meaningful).
            case["matmul_bound_ms"] = 1e3 * 2 * matmul_params(MODEL, args.dry_run) * prefill_tokens / 989e12
            results.append(case)
            print(f"\n{name}, {MODEL}{' (dry run)' if args.dry_run else ''}, prefill steps of {prefill_tokens} "
                  f"tokens (eager): step {case['step_ms']:.2f} ms, kernels {case['kernel_ms']:.2f} ms, "
                  f"{case['launches']:.0f} launches per step; {prefill_tokens / case['step_ms'] * 1e3:,.0f} tok/s; "
                  f"matrix products at 989 TFLOP/s {case['matmul_bound_ms']:.3f} ms")
        else:
            bound_ms = 1e3 * batch / weight_bound(MODEL, batch, dry=args.dry_run)
            case["bound_ms"] = bound_ms
            results.append(case)
            print(f"\n{name}, {MODEL}{' (dry run)' if args.dry_run else ''}, batch {batch}, {mode} "
                  f"({case['graphs']} graphs): step {case['step_ms']:.2f} ms, kernels {case['kernel_ms']:.2f} ms, "
                  f"{case['launches']:.0f} launches per step; weights-read bound {bound_ms:.3f} ms "
                  f"({bound_ms / case['step_ms']:.0%} of it reached)")
        print(f"  {'kernel' if device == 'cuda' else 'op':<60} {'per step':>8} {'us/step':>9} {'share':>6}")
        for row in case["top"]:
            print(f"  {row['name'][:60]:<60} {row['calls']:>8.1f} {row['us']:>9.1f} "
                  f"{row['us'] / max(1e-9, 1e3 * case['kernel_ms']):>6.1%}")
    return {"cases": [{"device": name, "model": MODEL, **case} for case in results]}


if __name__ == "__main__":
    harness.main(run, arguments)
