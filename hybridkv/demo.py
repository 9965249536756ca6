"""`hybridkv demo`: serve a batch with a shared system prompt on a tiny
Gemma-3-style and a tiny Jamba-style model (built on the fly, no download)
and show what the hybrid cache did."""

from __future__ import annotations

import random
import statistics
import time

from .tiny_models import sample_text, tiny_model_dir

SYSTEM = ("You are a helpful assistant for the city library. Answer in short sentences, name the shelf "
          "where a book stands, and never invent a title. ")


def _contiguous_bytes(layout, tokens: int) -> int:
    """What a cache sized for `tokens` per request, every layer, costs."""
    total = 0
    for group in layout.groups:
        if group.kind == "mamba":
            total += group.block_bytes
        else:
            total += group.num_layers * group.spec.bytes_per_token * tokens
    return total


def run_model(name: str, num_requests: int = 32, max_tokens: int = 32, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from .engine import Engine, SamplingParams

    path = tiny_model_dir(name)
    engine = Engine(path, kv_cache_memory="64MiB", max_num_seqs=16, max_num_batched_tokens=256, progress=False)
    rng = random.Random(0)
    system = SYSTEM + sample_text(rng, 120) + ". "
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(system + sample_text(rng, rng.randint(5, 30)) + "?", params)
           for _ in range(num_requests)]
    peak_pages = [0] * len(engine.layout.groups)
    peak_total = 0
    done: dict[str, object] = {}
    start = time.perf_counter()
    with tqdm(total=num_requests, desc=f"{name:<12}", unit="req", disable=not progress) as bar:
        while len(done) < num_requests:
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
    longest = max(len(o.prompt_token_ids) for o in outs) + max_tokens
    stats = engine.stats
    return {
        "model": name,
        "groups": [f"{g.kind}" for g in engine.layout.groups],
        "requests": num_requests,
        "tokens_per_s": generated / elapsed,
        "ttft_mean_ms": 1000 * statistics.mean(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "hit_rate": stats["prefix_hit_rate"],
        "peak_pages_by_group": peak_pages,
        "peak_bytes": peak_total * engine.layout.page_size_bytes,
        "contiguous_bytes": engine.scheduler.max_num_seqs * _contiguous_bytes(engine.layout, longest),
        "preemptions": stats["preemptions"],
        "sample": outs[0].outputs[0].text[:60],
    }


def main(num_requests: int = 32, max_tokens: int = 32, progress: bool = True) -> list[dict]:
    rows = [run_model(name, num_requests, max_tokens, progress) for name in ("tiny-gemma3", "tiny-jamba")]
    for row in rows:
        print(f"\n{row['model']}  ({' + '.join(row['groups'])} groups, {row['requests']} requests sharing a "
              f"system prompt, greedy, {max_tokens} new tokens each)")
        print(f"  output tokens/s          {row['tokens_per_s']:10.1f}")
        print(f"  TTFT mean / p90          {row['ttft_mean_ms']:8.1f} ms / {row['ttft_p90_ms']:.1f} ms")
        print(f"  prefix-cache hit rate    {100 * row['hit_rate']:9.1f} % of prompt tokens")
        groups = ", ".join(f"{k} {p}" for k, p in zip(row["groups"], row["peak_pages_by_group"]))
        print(f"  peak KV pages per group  {groups}")
        print(f"  peak KV bytes held       {row['peak_bytes'] / 2**20:9.2f} MiB, vs "
              f"{row['contiguous_bytes'] / 2**20:.2f} MiB for a contiguous per-request cache "
              f"({row['contiguous_bytes'] / max(1, row['peak_bytes']):.1f}x)")
        print(f"  preemptions              {row['preemptions']:10d}")
    print("\n(random weights: the text is noise; the numbers are what matters)")
    return rows
