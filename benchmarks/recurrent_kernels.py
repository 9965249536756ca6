"""The recurrent state updates on the CPU: the reference's torch ops
against the cpu backend's C recurrences (kernels.c `gated_delta`: Gated
DeltaNet; `ssd`: Mamba-2), as the recurrent ops call them, per token.

* decode: R requests one token each; the reference gathers their state
  rows, steps them (`gated_delta_step`, `ssd_step`) and writes them back,
  the C kernel updates the rows in place;
* prefill: R requests' chunks of L tokens; the reference runs the chunked
  forms (`gated_delta_scan`, `ssd_scan`, 64-token chunks) on gathered rows,
  the C kernel the recurrence token by token.

Shapes: the tiny models' heads, Qwen3-Next's and Qwen3.5's Gated DeltaNet
(16 key heads, 32 value heads of 128) and Nemotron-H-8B's Mamba-2 (128
heads of 64 channels in 8 groups, state 128). Both variants take turns
within each round (`--repeat` rounds, medians).

    python -m benchmarks.recurrent_kernels
    python -m benchmarks.recurrent_kernels --quick
"""

from __future__ import annotations

import statistics
import time

from benchmarks import harness

# (kind, shape name) -> dimensions: Gated DeltaNet (key heads, value heads, key dim, value dim);
# Mamba-2 (heads, head dim, groups, state size)
SHAPES = {("gated_delta", "tiny (2/4 heads of 16)"): (2, 4, 16, 16),
          ("gated_delta", "Qwen3-Next (16/32 heads of 128)"): (16, 32, 128, 128),
          ("ssd", "tiny (8 heads of 16, 2 groups, state 16)"): (8, 16, 2, 16),
          ("ssd", "Nemotron-H-8B (128 heads of 64, 8 groups, state 128)"): (128, 64, 8, 128)}


def ssd_inputs(requests: int, length: int, heads: int, head_dim: int, groups: int, state_size: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(requests, length, heads, head_dim, generator=gen)
    dt = torch.rand(requests, length, heads, generator=gen) + 0.1
    A, D = -torch.rand(heads, generator=gen) - 0.1, torch.randn(heads, generator=gen)
    B, C = (torch.randn(requests, length, groups, state_size, generator=gen) for _ in range(2))
    states = torch.randn(2 * requests + 1, heads, head_dim, state_size, generator=gen) * 0.1
    rows = torch.arange(requests) * 2 + 1
    return x, dt, A, B, C, D, states, rows


def ssd_variants(lib, case):
    """name -> a function running the case once."""
    import torch

    from hybridkv.layers.ssd_ops import ssd_scan, ssd_step

    x, dt, A, B, C, D, states, rows = case
    requests, length, heads, head_dim = x.shape
    lengths = torch.full((requests,), length, dtype=torch.int64)
    y = torch.empty(*x.shape)

    def reference():
        if length == 1:
            _, new = ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, states[rows])
        else:
            _, new, _ = ssd_scan(x, dt, A, B, C, D, states[rows], lengths)
        states[rows] = new

    def kernel():
        lib.ssd(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                lengths.data_ptr(), requests, length, heads, head_dim, B.shape[2], B.shape[3], states.data_ptr(),
                rows.data_ptr(), states.stride(0), y.data_ptr(), torch.get_num_threads())

    return {"torch reference": reference, "C": kernel}


def inputs(requests: int, length: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int):
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(requests, length, key_heads, key_dim, generator=gen), dim=-1) * key_dim ** -0.5
    k = F.normalize(torch.randn(requests, length, key_heads, key_dim, generator=gen), dim=-1)
    v = torch.randn(requests, length, value_heads, value_dim, generator=gen)
    g = -torch.rand(requests, length, value_heads, generator=gen)
    beta = torch.rand(requests, length, value_heads, generator=gen)
    # the gathered states of a step: more rows than requests, these requests' scattered among them
    states = torch.randn(2 * requests + 1, value_heads, key_dim, value_dim, generator=gen) * 0.1
    rows = torch.arange(requests) * 2 + 1
    return q, k, v, g, beta, states, rows


def variants(lib, case):
    """name -> a function running the case once."""
    import torch

    from hybridkv.layers.gated_delta_ops import gated_delta_scan, gated_delta_step

    q, k, v, g, beta, states, rows = case
    requests, length = q.shape[:2]
    lengths = torch.full((requests,), length, dtype=torch.int64)
    out = torch.empty(*v.shape)

    def reference():
        if length == 1:
            y, new = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states[rows])
        else:
            y, new, _ = gated_delta_scan(q, k, v, g, beta, states[rows], lengths)
        states[rows] = new

    def kernel():
        lib.gated_delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), lengths.data_ptr(),
                        requests, length, q.shape[2], v.shape[2], q.shape[3], v.shape[3], states.data_ptr(),
                        rows.data_ptr(), states.stride(0), out.data_ptr(), torch.get_num_threads())

    return {"torch reference": reference, "C": kernel}


def timed(fn, seconds: float) -> float:
    """Seconds per call: calls for about `seconds`, after one to warm up."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def run(args) -> dict:
    import torch

    from hybridkv.layers.backends.cpu import kernels

    lib = kernels()
    cases = [("decode", r, 1) for r in (1, 16, 64)] + [("prefill", 1, 512), ("prefill", 4, 512)]
    shapes = SHAPES
    seconds = 0.3
    if args.quick:
        cases, seconds = [("decode", 4, 1), ("prefill", 2, 70)], 0.01
        shapes = {key: dims for key, dims in SHAPES.items() if key[1].startswith("tiny")}
    print(f"float32, {args.threads} threads; µs per token, medians of {args.repeat} interleaved rounds")
    print(f"{'kind':<12} {'heads':<52} {'work':<8} {'requests':>8} {'tokens':>6} {'reference':>10} {'C':>10} "
          f"{'speed-up':>9}")
    rows = []
    torch.set_grad_enabled(False)
    for (kind, shape), dims in shapes.items():
        for work, requests, length in cases:
            if kind == "ssd":
                fns = ssd_variants(lib, ssd_inputs(requests, length, *dims))
            else:
                fns = variants(lib, inputs(requests, length, *dims))
            runs = harness.interleaved({name: (lambda fn=fn: timed(fn, seconds)) for name, fn in fns.items()},
                                       args.repeat)
            tokens = requests * length
            per_token = {name: 1e6 * statistics.median(times) / tokens for name, times in runs.items()}
            speedup = per_token["torch reference"] / per_token["C"]
            print(f"{kind:<12} {shape:<52} {work:<8} {requests:>8} {length:>6} {per_token['torch reference']:>10.2f} "
                  f"{per_token['C']:>10.2f} {speedup:>8.2f}x")
            rows.append({"kind": kind, "shape": shape, "work": work, "requests": requests, "tokens": length,
                         "reference_us_per_token": per_token["torch reference"], "c_us_per_token": per_token["C"],
                         "speedup": speedup, "runs": runs})
    return {"tokens": rows}


if __name__ == "__main__":
    harness.main(run, repeat=3)
