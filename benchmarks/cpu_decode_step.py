"""A decode step of the real Gemma-3 270M on this CPU, taken apart: the
engine as it is beside the engine with one choice undone, and at batch 1
the step against the time its matrix products alone take.

Configurations (one engine, switched in place, interleaved `--repeat` times,
every other round in reverse order;
medians of the steady steps, where every sequence decodes):

  engine         as shipped: the "cpu" backend. Steps of up to
                 decoder.max_rows sequences (3; 11 in bfloat16 on
                 the CPU's bfloat16 dot product) run each decoder layer as
                 one C call (layers/backends/cpu/decoder.py, the route
                 "cpu:decoder-layers"); bigger ones run it as five C calls
                 between the modules' products ("cpu:decoder-stages"):
                 decode attention, norms, rotary and the gated activation
                 in hybridkv's C kernels and every weight in oneDNN's
                 packed layout, the tied LM head included (a second copy,
                 the embedding keeps the dense one)
  no stages      the steps bigger than decoder.max_rows through the modules
  layer modules  every step through the modules
  gathered decode  the modules, and decode attention as the torch reference
                 runs it: every page a decode group reads gathered
                 (index_select), then two batched matmuls
  torch elementwise  the modules, with norms, rotary and activations as
                 torch ops
  oneDNN LM head  the LM head's product as oneDNN's over its packed copy on
                 every step (the engine's bfloat16 steps of up to
                 head.MAX_ROWS rows run it in C over a tiled copy:
                 layers/backends/cpu/head.py)
  dense LM head  the tied LM head read dense by oneDNN

Workload per batch B: B prompts of 128 tokens (real text, no shared blocks),
greedy; each configuration must give the same tokens.

At batch 1 the floor of a step is reading every weight once: the script
times a sum over every Linear's weight (memory's rate on this machine) and
the model's own Linear modules called in a row on one token (oneDNN's
products, nothing else), and prints the step beside both.

    python -m benchmarks.cpu_decode_step            # batch 1, 16, 64; ~3 min
    python -m benchmarks.cpu_decode_step --dtype bfloat16   # the weights in bfloat16
    python -m benchmarks.cpu_decode_step --quick    # CI smoke run
"""

from __future__ import annotations

import statistics
import time

from benchmarks import harness


def steady_steps(engine, prompts, new_tokens) -> tuple[list[float], list[int]]:
    """Seconds of each step in which every sequence decodes (all have a
    token, none finishes), and the first prompt's tokens."""
    from hybridkv import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    started, tokens, times = set(), {}, []
    while engine.scheduler.has_work():
        steady = len(started) == len(ids)
        t = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t
        finished = False
        for out in outputs:
            tokens[out.request_id] = out.outputs[0].token_ids
            started.add(out.request_id)
            finished |= out.finished
        if steady and not finished and len(outputs) == len(ids):  # (none finished in an earlier step)
            times.append(elapsed)
    return times, list(tokens[ids[0]])


def linears_alone(model, repeat: int) -> float:
    """Seconds to run every Linear of the model once on one token, in a
    row: the products of a batch-1 step through the modules, nothing else."""
    import torch

    from hybridkv.layers.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(1, m.in_features, dtype=m.weight.dtype) for m in linears]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat):
            start = time.perf_counter()
            for m, x in zip(linears, inputs):
                m(x)
            best = min(best, time.perf_counter() - start)
    return best


def weights_read(model, repeat: int, dtype) -> float:
    """Seconds to read as many bytes as the Linear weights in `dtype`,
    once, in float32 tensors of their byte sizes (a sum over each; torch's
    bfloat16 sum is far slower than memory, and oneDNN's packed copies
    cannot be summed): what memory allows a batch-1 step."""
    import torch

    from hybridkv.layers.linear import Linear

    copies = [torch.ones(m.out_features * m.in_features * dtype.itemsize // 4) for m in model.modules()
              if isinstance(m, Linear)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat):
            start = time.perf_counter()
            for w in copies:
                w.sum()
            best = min(best, time.perf_counter() - start)
    return best


def run(args) -> dict:
    from benchmarks import real_gemma3
    from hybridkv import Engine, SamplingParams
    from hybridkv.layers.backends.cpu import decoder, modules
    from hybridkv.layers.linear import Linear

    batches, new_tokens, repeat = ([1, 2], 6, 1) if args.quick else ([1, 16, 64], 40, args.repeat)
    work = {b: real_gemma3.batch_prompts(b, 128) for b in batches}
    engine = Engine(real_gemma3.gguf_path(), kv_cache_memory=real_gemma3.kv_budget(work[batches[-1]], new_tokens),
                    max_num_seqs=max(batches), progress=False, dtype=args.dtype)
    engine.generate([work[1][0][:16]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    model = engine.worker.model
    head, packed_head = model.lm_head, getattr(model.lm_head, "packed", None)
    head_rows = getattr(head, "max_rows", None)  # (a TiledHead's: head.py)
    native = engine.backend.name == "cpu"
    shipped_usable = modules.usable

    def switch(layer_modules=False, gathered=False, elementwise=False, dense_head=False, no_stages=False,
               onednn_head=False):
        """Undo the chosen parts of the shipped engine (none: as shipped)."""
        if native:
            engine.backend.decoder_rows = 0 if layer_modules or gathered or elementwise else shipped_rows
            engine.backend.decoder_stages = not no_stages
        if packed_head is not None:
            head.packed = None if dense_head else packed_head
        if head_rows is not None:
            head.max_rows = 0 if dense_head or onednn_head else head_rows
        modules.usable = (lambda x: False) if elementwise else shipped_usable  # the C norms, rotary, activation
        if native:  # the reference's decode groups where the kernel "cannot" read the pool
            engine.backend.attention.supports = (lambda q, cache: False) if gathered else cpu_attention_supports

    cpu_attention_supports = engine.backend.attention.supports if native else None
    shipped_rows = engine.backend.decoder_rows if native else 0
    configs = {"engine": {}, "no stages": {"no_stages": True}, "layer modules": {"layer_modules": True},
               "gathered decode": {"gathered": True},
               "torch elementwise": {"elementwise": True}, "oneDNN LM head": {"onednn_head": True},
               "dense LM head": {"dense_head": True}}
    if not native:  # no C kernels here: nothing to undo
        for name in ("no stages", "layer modules", "gathered decode", "torch elementwise"):
            configs.pop(name)
    elif not isinstance(model.model.layers[0], decoder.CpuDecoderLayer):
        # no room for the decoder layers' dense weights: the engine runs the modules
        configs.pop("layer modules"), configs.pop("no stages")
    if packed_head is None or head.weight.numel() == 0:
        configs.pop("dense LM head")  # not the oneDNN path (another device or dtype): nothing to compare
    if head_rows is None:
        configs.pop("oneDNN LM head")  # no C head here (float32, or no bfloat16 dot product)
    steps = {(b, name): [] for b in batches for name in configs}
    first_ids = {}
    try:
        for round_ in range(repeat):
            for b in batches:
                # (every other round in reverse: this VM's speed drifts, and a fixed order would bias the first)
                for name, undo in list(configs.items())[::-1 if round_ % 2 else 1]:
                    switch(**undo)
                    engine.kv.reset_prefix_cache()
                    times, ids = steady_steps(engine, work[b], new_tokens)
                    steps[(b, name)].append(statistics.median(times))
                    first_ids.setdefault(b, {})[name] = ids
    finally:
        switch()
    for b, ids in first_ids.items():
        # In bfloat16 each choice rounds its sums in its own order, and greedy tokens part after a few
        # steps (the engine's own bfloat16 accuracy is tests/test_real_gemma3_bfloat16.py's subject).
        if len({tuple(v) for v in ids.values()}) != 1 and args.dtype == "float32":
            raise SystemExit(f"batch {b}: the configurations gave different tokens: {ids}")

    print(f"Gemma-3 270M (real weights, {args.dtype}), {args.threads} threads; decode step ms, medians of "
          f"{repeat} run(s) (tokens/s)")
    print(f"{'batch':>5} " + " ".join(f"{name:>18}" for name in configs))
    rows = []
    for b in batches:
        cells = {name: statistics.median(steps[(b, name)]) for name in configs}
        print(f"{b:>5} " + " ".join(f"{f'{s * 1e3:.1f} ({b / s:.0f})':>18}" for s in cells.values()))
        rows.append({"batch": b, **{f"{name.replace(' ', '_')}_s": s for name, s in cells.items()}})

    dtype = next(model.parameters()).dtype
    weights = sum(m.in_features * m.out_features * dtype.itemsize for m in model.modules() if isinstance(m, Linear))
    products = linears_alone(model, 3 if args.quick else 20)
    read = weights_read(model, 3 if args.quick else 20, dtype)
    step1 = statistics.median(steps[(1, "engine")])
    print(f"\nbatch 1: {weights / 1e9:.2f} GB of weights read per step. Reading them once (a sum over each) takes "
          f"{read * 1e3:.1f} ms ({weights / read / 1e9:.0f} GB/s): the floor of this design")
    print(f"the model's Linear modules alone on one token (oneDNN): {products * 1e3:.1f} ms, "
          f"{products / read:.2f}x the floor")
    print(f"the engine's step: {step1 * 1e3:.1f} ms, {step1 / read:.2f}x the floor "
          f"({(step1 - read) * 1e3:.1f} ms of attention, norms, rotary, sampling, scheduling and slower reads)")
    return {"steps": rows,
            "batch1": [{"weight_bytes": weights, "read_s": read, "linears_s": products, "step_s": step1}],
            "first_ids": [{"batch": b, "ids": v["engine"]} for b, v in first_ids.items()]}


def arguments(parser) -> None:
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the engine's weights and activations (default float32)")


if __name__ == "__main__":
    harness.main(run, arguments, repeat=3, out=lambda args: "cpu_decode_step.json" if args.dtype == "float32"
                 else f"cpu_decode_step_{args.dtype}.json")
