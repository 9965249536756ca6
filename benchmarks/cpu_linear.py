"""The matrix products of a decode step on the CPU: torch's `F.linear` (MKL
GEMM) against oneDNN's matmul (torch.ops.mkldnn) on the dense weight and on
a copy reordered to its layout, for the shapes of Gemma-3 270M's layers and
its 262,144 x 640 LM head, float32, at batch 1, 16 and 64. This is what
the cpu backend chooses from (layers/backends/cpu/linear.py).

The weights are larger than the caches (each shape is replicated to ~64 MB
and cycled through, as a step reads 18 layers' weights once each), so the
table reads as the rate at which each product streams weights from memory.

    python -m benchmarks.cpu_linear
    python -m benchmarks.cpu_linear --quick
"""

from __future__ import annotations

import time

from benchmarks import harness

SHAPES = {"q,k,v": (640, 1536), "o": (1024, 640), "gate,up": (640, 4096), "down": (2048, 640),
          "lm_head": (640, 262144)}


def timed(fn, weights, repeat) -> float:
    for w in weights[:2]:
        fn(w)
    start = time.perf_counter()
    for i in range(repeat):
        fn(weights[i % len(weights)])
    return (time.perf_counter() - start) / repeat


def run(args) -> dict:
    import torch
    import torch.nn.functional as F

    ops = torch.ops.mkldnn
    shapes = {"o": SHAPES["o"], "lm_head": (640, 16384)} if args.quick else SHAPES
    batches = [1, 4] if args.quick else [1, 16, 64]
    print(f"float32, {args.threads} threads; ms per product (GB/s of weights read)")
    print(f"{'weights':<9} {'K x N':>13} {'batch':>5} {'F.linear':>16} {'oneDNN dense':>16} {'oneDNN packed':>16} "
          f"{'best / F.linear':>15}")
    rows = []
    for name, (k, n) in shapes.items():
        nbytes = k * n * 4
        copies = max(1, (64 << 20) // nbytes) if not args.quick else 1
        dense = [torch.randn(n, k) for _ in range(copies)]
        packed = [ops._reorder_linear_weight(w, 16) for w in dense]
        for batch in batches:
            x = torch.randn(batch, k)
            repeat = max(3, min(200, (2 << 30) // nbytes // 4)) if not args.quick else 2
            t_torch = timed(lambda w: F.linear(x, w), dense, repeat)
            t_dense = timed(lambda w: ops._linear_pointwise(x, w, None, "none", [], ""), dense, repeat)
            t_packed = timed(lambda w: ops._linear_pointwise(x, w, None, "none", [], ""), packed, repeat)
            cells = [f"{t * 1e3:7.2f} ({nbytes / t / 1e9:5.1f})" for t in (t_torch, t_dense, t_packed)]
            gain = t_torch / min(t_dense, t_packed)
            print(f"{name:<9} {f'{k} x {n}':>13} {batch:>5} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} "
                  f"{gain:>14.2f}x")
            rows.append({"weights": name, "k": k, "n": n, "batch": batch, "f_linear_s": t_torch,
                         "onednn_dense_s": t_dense, "onednn_packed_s": t_packed})
    return {"products": rows}


if __name__ == "__main__":
    harness.main(run)
