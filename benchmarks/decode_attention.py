"""The CPU's decode attention (kernels.c `decode_attention`) over long rows
of pages, this source's build beside another revision's, taking turns.

Rows as a batch-64 decode step of the real Gemma-3 270M reads them (one
KV head 256 wide, four query heads): every row over 4,096 keys (a full
layer), and over a 512- and a 128-key window (sliding layers); float32,
bfloat16 and int8 pages of 16 slots, scattered over the pool. Each call of
a window reads other pages than the last (as each layer reads its own), so
no case runs out of a cache that a real step would not have. Reports the
median time per call and the rate at which it reads the rows' keys and
values, per build, and the baseline's time over this build's.

    python -m benchmarks.decode_attention --baseline HEAD~1   # ~1 min
    python -m benchmarks.decode_attention --quick             # CI smoke run

`--baseline REV` builds kernels.c as it is at git revision REV (into a
temporary folder; its structs must be this source's) and runs both in one
process, every other round in reverse order: these machines are noisy.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import harness

DTYPES = ("float32", "bfloat16", "int8")


def arguments(parser) -> None:
    parser.add_argument("--baseline", default=None,
                        help="a git revision whose kernels.c runs beside this one's (default: none)")
    parser.add_argument("--rows", type=int, default=64)


def baseline_build(revision: str, folder: str) -> Path:
    """kernels.c at `revision`, built as build.py builds it, into `folder`."""
    from hybridkv.core.native import CPU_KERNELS, NativeLibrary

    source = subprocess.run(["git", "show", f"{revision}:hybridkv/layers/backends/cpu/kernels.c"], check=True,
                            cwd=harness.ROOT, capture_output=True, text=True).stdout
    path = Path(folder) / "kernels.c"
    path.write_text(source)
    baseline = NativeLibrary(path, CPU_KERNELS.flags, CPU_KERNELS.cache_name, Path(folder), CPU_KERNELS.libs)
    return baseline.build_into(Path(folder))


def pool_and_rows(dtype: str, rows: int, keys: int, window: int | None, quick: bool):
    """A pool of `dtype` pages holding `rows` rows of `keys` keys, and per
    call the rows' decode view: the whole rows, or windows of `window` keys
    (each call another, at most 8)."""
    import torch

    from hybridkv.layers.backends.cpu.attention import CpuDecodes
    from hybridkv.layers.kv_quant import QuantizedCache, quantize

    gen = torch.Generator().manual_seed(0)
    bs, dim = 16, 64 if quick else 256
    blocks = keys // bs
    cache = torch.randn(1 + rows * blocks, 2, bs, 1, dim, generator=gen)
    if dtype == "int8":
        pool = QuantizedCache(*quantize(cache, torch.int8))
    else:
        pool = cache.to(getattr(torch, dtype))
    pages = (torch.randperm(rows * blocks, generator=gen) + 1).view(rows, blocks)
    width = keys if window is None else window
    views = []
    for k in range(min(8, keys // width)):
        part = pages[:, k * width // bs:(k + 1) * width // bs].contiguous()
        views.append(CpuDecodes(torch.arange(rows), part[None], torch.zeros(rows, dtype=torch.int64),
                                torch.full((rows,), width - 1, dtype=torch.int64)))
    q = torch.randn(rows, 4, dim, generator=gen)
    row_bytes = dim * {"float32": 4, "bfloat16": 2, "int8": 1}[dtype] + (4 if dtype == "int8" else 0)  # (a scale)
    return pool, views, q, 2 * rows * width * row_bytes


def run(args) -> dict:
    import torch

    from hybridkv.layers.backends.cpu import library
    from hybridkv.layers.backends.cpu.attention import CpuAttention

    current = library.load()
    if current is None:
        raise SystemExit("the cpu kernels are not built here: python -m hybridkv.cli build-kernels")
    builds = {"this": current}
    scratch = tempfile.TemporaryDirectory()
    if args.baseline:
        builds["baseline"] = library.Kernels(baseline_build(args.baseline, scratch.name),
                                             Path(scratch.name) / "kernels.c")  # read by its own structs
    rows, keys = (4, 512) if args.quick else (args.rows, 4096)
    cases = [(dtype, window) for dtype in DTYPES for window in (None, 512, 128)]
    out = []
    print(f"{rows} rows of {keys} keys, or windows of them: median ms per call, GB/s of K/V rows read")
    for dtype, window in cases:
        pool, views, q, nbytes = pool_and_rows(dtype, rows, keys, window, args.quick)
        times: dict[str, list[float]] = {name: [] for name in builds}
        results = {}
        for round_ in range(max(2, 4 * args.repeat)):
            for name, lib in builds.items() if round_ % 2 == 0 else list(builds.items())[::-1]:
                ops = CpuAttention(lib)
                start = time.perf_counter()
                for view in views:
                    results[name] = ops.attend_decodes(q, pool, view, 0, 0.0625, None, None)
                times[name].append((time.perf_counter() - start) / len(views))
        if len(results) > 1 and not torch.allclose(results["this"], results["baseline"], rtol=1e-4, atol=1e-5):
            raise RuntimeError(f"{dtype} pages, window {window}: the two builds' outputs differ")
        row = {"dtype": dtype, "keys": window or keys, "rows": rows, "bytes": nbytes}
        for name, values in times.items():
            median = statistics.median(values)
            row[name] = {"ms": 1e3 * median, "gb_per_s": nbytes / median / 1e9}
        if "baseline" in row:
            row["speedup"] = row["baseline"]["ms"] / row["this"]["ms"]
        out.append(row)
        print(f"  {dtype:<9} {row['keys']:>5} keys: " + ", ".join(
            f"{name} {row[name]['ms']:.2f} ms ({row[name]['gb_per_s']:.1f} GB/s)" for name in builds) +
            (f", {row['speedup']:.2f}x" if "speedup" in row else ""))
    scratch.cleanup()
    return {"cases": out, "baseline": args.baseline}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3)
