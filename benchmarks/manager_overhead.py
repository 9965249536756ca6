"""Manager overhead: replay request traces through KVCacheManager alone.

The traces (benchmarks/replay_trace.py): "mixed" (independent prompts, most
opening with one system prompt), "multi-turn" (chats whose turns append the
answer and a new message to the previous prompt, each turn arriving when
the one before it finished) and "shared-system" (a few long system prompts,
short unique questions).

A scheduler loop admits waiting requests while the pool allows (lookup,
allocate, mark computed, chunk by chunk; a chunk runs past Mamba checkpoints as in the engine), then
decodes one token for every running request (append, allocate 1, mark 1:
the batched calls, `*_many`, as an engine's step makes them), and frees
finished ones. Reports microseconds per admission and per decode
request-step, peak pages and the prefix hit rate; a second table shows that
the per-step cost does not grow with the pool size or the context length.

    python -m benchmarks.manager_overhead            # full run, fastest of 2 rounds
    python -m benchmarks.manager_overhead --quick    # seconds, for CI
    python -m benchmarks.manager_overhead --against vllm --events
        # also vLLM's KVCacheManager on the same traces (run it with an interpreter that has
        # vllm), and hybridkv with KV events on; the variants take turns of 64 admissions or steps
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from benchmarks import harness
from benchmarks.replay_trace import CONFIGS, MODELS_DIR, TRACES, Waiting, trace_named
from hybridkv.core import KVCacheManager, RecurrentSpec, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config


# Side by side, the variants take turns of this many admissions and decode
# steps (harness.lockstep): tens of ms, so each runs with its own data in the
# CPU caches, as whole runs taking turns did, while a slow spell of the
# machine (seconds) falls on all of them.
TURN = 64

# The manager as the engine makes it: every backend saves a recurrent
# state at a checkpoint inside a prefill chunk (Capabilities.
# checkpoints_inside_chunks), so a prompt's chunk runs past its checkpoints
# instead of ending at each (one allocation and mark for the prompt, not two).
AS_THE_ENGINE = dict(checkpoints_inside_chunks=True)


def _prefill(kv: KVCacheManager, rid: str, chunk: int) -> bool:
    """Lookup, allocate and mark computed, chunk by chunk (`next_chunk`: past
    Mamba checkpoints where the pool has room for their states), until the
    prompt is computed; False if the pool is full."""
    total = kv.num_tokens(rid)
    while True:
        size = kv.next_chunk(rid, chunk)
        if not kv.allocate_slots(rid, size):
            return False
        kv.mark_computed(rid, size)
        if kv.num_computed_tokens(rid) >= total:
            return True


def replay(kv: KVCacheManager, trace, max_running: int = 256, chunk: int = 1 << 30, take_events: bool = False) -> dict:
    """FCFS with recompute preemption (the newest running request goes back
    to the head of the queue when a decode step finds no page).
    `take_events`: the manager records KV events and they are taken after
    every admission and decode step (timed with it), as a server does."""
    return harness.run_through(replay_steps(kv, trace, max_running, chunk, take_events))


def replay_steps(kv: KVCacheManager, trace, max_running: int = 256, chunk: int = 1 << 30,
                 take_events: bool = False):
    """`replay`, yielding after every admission and decode step (untimed:
    harness.lockstep runs variants side by side) and returning its row."""
    drain = kv.take_events if take_events else (lambda: None)
    # A server builds its manager once, at start-up, long before the requests
    # come: by then its objects (per-page lists of the whole pool) are in
    # Python's oldest generation, which the young collections during the
    # requests do not traverse. So here, before the first request, as
    # vllm_replay does before freezing vLLM's (its engine freezes them).
    gc.collect()
    waiting = Waiting(trace)
    running: dict[str, list] = {}  # id -> [outputs left, samples, tokens so far]
    admit_time = failed_time = decode_time = 0.0
    admissions = failed = decode_steps = preemptions = 0
    peak_used = 0
    perf = time.perf_counter
    while waiting or running:
        while waiting and len(running) < max_running:
            rid, tokens, outputs, samples = waiting.head()
            t0 = perf()
            if rid not in kv:
                kv.add_request(rid, tokens)
            ok = _prefill(kv, rid, chunk)
            if not ok:
                failed_time += perf() - t0
                failed += 1
                if not running:
                    raise RuntimeError("a single request does not fit the pool")
                break
            drain()
            admit_time += perf() - t0
            admissions += 1
            waiting.admitted()
            running[rid] = [outputs, samples, tokens]
            yield
        peak_used = max(peak_used, kv.num_total_pages - kv.num_free_pages)
        t0 = perf()
        finished = []
        preempted = []
        ids = list(running)
        tokens = [state[1][state[0] & 7] for state in running.values()]
        kv.append_token_ids_many(ids, tokens)
        done = 0
        while done < len(ids):
            done += kv.allocate_slots_many(ids[done:] if done else ids, 1)
            if done < len(ids):  # out of pages: preempt the newest request left
                victim = ids.pop()
                tokens.pop()
                preempted.append(victim)
                kv.free(victim)
        kv.mark_computed_many(ids, 1)
        for rid, token in zip(ids, tokens):
            state = running[rid]
            state[2].append(token)
            state[0] -= 1
            if state[0] <= 0:
                finished.append(rid)
        decode_steps += len(ids)
        for rid in finished:
            kv.free(rid)
            del running[rid]
        for rid in reversed(preempted):
            outputs, samples, tokens = running.pop(rid)
            waiting.requeue((rid, tokens, outputs, samples))
            preemptions += 1
        drain()
        decode_time += perf() - t0
        for rid in finished:  # the next turns of these chats arrive (untimed: the trace, not the manager)
            waiting.finished(rid)
        yield
    stats = kv.stats
    return {
        "admissions": admissions,
        "us_per_admission": 1e6 * admit_time / max(1, admissions),
        "failed_admissions": failed,
        "us_per_failed_admission": 1e6 * failed_time / max(1, failed),
        "preemptions": preemptions,
        "decode_request_steps": decode_steps,
        "us_per_decode_step": 1e6 * decode_time / max(1, decode_steps),
        "peak_pages": peak_used,
        "total_pages": kv.num_total_pages,
        "hit_rate": stats.hit_rate,
        "prompt_tokens": stats.queried_tokens,
        "hit_tokens": stats.hit_tokens,
    }


def scaling(specs, quick: bool) -> list[dict]:
    """Per decode-step cost at growing pool sizes and contexts: 64 requests
    decoding 256 tokens at a fixed context, nothing else going on."""
    rows = []
    pools = [10**3, 10**4, 10**5, 10**6] if not quick else [10**3, 10**4]
    contexts = [1024, 8192, 32768, 131072] if not quick else [1024, 8192]
    probe = plan_layout(specs, 1 << 40)
    per_page = probe.page_size_bytes
    for pages in pools:
        for context in contexts:
            # The prompt, the untimed first token and 256 timed ones; beside a
            # recurrent group's running state, its prompt-end checkpoint.
            states = sum(g.pages_per_block for g in probe.groups if g.recurrent)
            need = 8 * (probe.pages_per_request(context + 257, 512) + states)
            if need > pages:
                continue
            kv = KVCacheManager(plan_layout(specs, per_page * pages), enable_prefix_caching=True, **AS_THE_ENGINE)
            rids = []
            for i in range(8):
                rid = f"s{i}"
                kv.add_request(rid, [i + 1] * context)
                while kv.num_computed_tokens(rid) < context:
                    n = min(4096, context - kv.num_computed_tokens(rid))
                    assert kv.allocate_slots(rid, n)
                    kv.mark_computed(rid, n)
                rids.append(rid)
            for rid in rids:
                # Untimed first token: it grows each prompt-sized token list
                # once (a copy of the whole list, once per request's life),
                # which would otherwise dominate a 128K cell's 2,048 steps.
                kv.append_token_ids(rid, [1])
                assert kv.allocate_slots(rid, 1)
                kv.mark_computed(rid, 1)
            t0 = time.perf_counter()
            steps = 0
            for step in range(256):
                for rid in rids:
                    kv.append_token_ids(rid, [step + 1])
                    assert kv.allocate_slots(rid, 1)
                    kv.mark_computed(rid, 1)
                    steps += 1
            rows.append({"pool_pages": pages, "context": context,
                         "us_per_decode_step": 1e6 * (time.perf_counter() - t0) / steps})
    return rows


def fastest(rows: list[dict]) -> dict:
    """Rounds of one replay: every timing (the "us_" fields) at its
    minimum; the rest (counts, hit rate) is the same in every round."""
    best = dict(rows[0])
    for row in rows[1:]:
        for key, value in row.items():
            if key.startswith("us_"):
                best[key] = min(best[key], value)
    return best


def round_ratio(theirs: list[dict], ours: list[dict], key: str) -> float:
    """The median over rounds of their time over ours in the same round:
    within a round the two ran side by side, so a slow spell of the machine
    cancels out; the fastest rounds of each may come from different spells."""
    return statistics.median(them[key] / us[key] for them, us in zip(theirs, ours))


def against_vllm(runs: dict[str, list[dict]], variant: str) -> dict:
    """A variant's ratios against vLLM's rounds: times per round
    (round_ratio), and its hit tokens over vLLM's (None where vLLM hit none)."""
    ours, theirs = runs[variant], runs["vllm"]
    hits = theirs[0]["hit_tokens"]
    return {"admission_ratio": round_ratio(theirs, ours, "us_per_admission"),
            "decode_ratio": round_ratio(theirs, ours, "us_per_decode_step"),
            "hit_ratio": ours[0]["hit_tokens"] / hits if hits else None}


def print_vllm(version: str, rows: list[dict], notes: list[str]) -> None:
    """vLLM's rows beside ours, with vLLM time / hybridkv time."""
    print(f"\nvLLM {version} KVCacheManager, same traces (ratio = vLLM time / hybridkv time in the same round, "
          "median of rounds; hit x = hybridkv's hit tokens / vLLM's)")
    print(f"{'model':<26} {'trace':<14} {'groups':>6} {'us/admission':>13} {'(Request)':>10} {'us/decode step':>15} "
          f"{'preempt':>8} {'peak blocks':>12} {'hit tokens':>11} {'hit rate':>9} {'adm. x':>7} {'decode x':>9} "
          f"{'hit x':>6}")
    for row in rows:
        print(f"{row['model']:<26} {row['trace']:<14} {row['groups']:>6} {row['us_per_admission']:>13.1f} "
              f"{row['us_per_request_build']:>10.1f} {row['us_per_decode_step']:>15.2f} "
              f"{row['preemptions']:>8} {row['peak_pages']:>12,} {row['hit_tokens']:>11,} "
              f"{row['hit_rate']:>9.1%} {row['admission_ratio']:>7.2f} {row['decode_ratio']:>9.2f} "
              f"{'-' if row['hit_ratio'] is None else format(row['hit_ratio'], '.2f'):>6}")
    print("(Request): the part of us/admission spent building the vLLM Request, which hashes the prompt's blocks")
    print("\n".join(notes))


def print_wide(rows: list[dict]) -> None:
    """The models with recurrent layers again, at wider blocks."""
    print(f"\nhybridkv at {rows[0]['block_size']}-token blocks (models with recurrent layers; x: against vLLM's, "
          "as above)")
    print(f"{'model':<26} {'trace':<14} {'us/admission':>13} {'us/decode step':>15} {'hit tokens':>11} "
          f"{'hit rate':>9} {'adm. x':>7} {'decode x':>9} {'hit x':>6}")
    for row in rows:
        them = row.get("vs_vllm")
        ratios = (f"{them['admission_ratio']:>7.2f} {them['decode_ratio']:>9.2f} "
                  f"{'-' if them['hit_ratio'] is None else format(them['hit_ratio'], '.2f'):>6}") if them else ""
        print(f"{row['model']:<26} {row['trace']:<14} {row['us_per_admission']:>13.1f} "
              f"{row['us_per_decode_step']:>15.2f} {row['hit_tokens']:>11,} {row['hit_rate']:>9.1%} {ratios}")


def print_events(rows: list[dict]) -> None:
    print("\nKV events on (recorded, and taken after every admission and decode step) against off")
    print(f"{'model':<26} {'trace':<14} {'us/admission off':>17} {'on':>8} {'change':>7} {'us/decode step off':>19} "
          f"{'on':>8} {'change':>7}")
    for row in rows:
        off, on = row["off"], row["on"]
        print(f"{row['model']:<26} {row['trace']:<14} {off['us_per_admission']:>17.1f} {on['us_per_admission']:>8.1f} "
              f"{row['admission_change']:>+7.1%} {off['us_per_decode_step']:>19.2f} {on['us_per_decode_step']:>8.2f} "
              f"{row['decode_change']:>+7.1%}")


def arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="per trace (--quick: 60)")
    parser.add_argument("--traces", default=",".join(TRACES),
                        help=f"comma-separated, from {', '.join(TRACES)}, or unique-L: prompts of L tokens that "
                             "share nothing (benchmarks/replay_trace.py)")
    parser.add_argument("--memory", default="40GiB", help="KV budget per model")
    parser.add_argument("--against", choices=["vllm"], default=None,
                        help="also replay the traces through vLLM's own KVCacheManager (benchmarks/vllm_replay.py)")
    parser.add_argument("--events", action="store_true",
                        help="also replay with KV events on (recorded and taken every step)")
    parser.add_argument("--wide-block", type=int, default=64,
                        help="also replay the models with recurrent layers at this block size, tokens (0: not)")


def run(args) -> dict:
    """Each trace on each model, `--repeat` rounds, the variants (hybridkv,
    with events, vLLM's) side by side in each round, taking turns of TURN
    admissions and decode steps (harness.lockstep); each timing is the
    fastest round's, each ratio against vLLM the median of the rounds'
    (round_ratio)."""
    vllm_replay = None
    if args.against == "vllm":  # vLLM stays optional: imported only here, checked before the long run
        from benchmarks import vllm_replay
        try:
            vllm_version = vllm_replay.import_vllm().__version__
        except vllm_replay.VLLMUnavailable as e:
            raise SystemExit(str(e))
    num = 60 if args.quick else args.requests
    names = [name.strip() for name in args.traces.split(",") if name.strip()]
    traces = {}
    for name in names:
        try:
            traces[name] = trace_named(name, num)
        except ValueError as e:
            raise SystemExit(f"--traces: {e}") from None
    tables: dict = {"models": [], "scaling": []}
    print(f"{'model':<26} {'trace':<14} {'groups':>6} {'us/admission':>13} {'us/decode step':>15} "
          f"{'us/failed adm.':>15} {'preempt':>8} {'peak pages':>11} {'hit tokens':>11} {'hit rate':>9}")
    theirs, events, notes, wide = [], [], [], []
    for name in names:
        trace = traces[name]
        for label, file in CONFIGS.items():
            path = os.path.join(MODELS_DIR, file)
            specs = specs_from_config(load_config(path))
            layout = plan_layout(specs, args.memory)
            variants = {"hybridkv": lambda: replay_steps(KVCacheManager(layout, **AS_THE_ENGINE), trace)}
            if args.events:
                variants["events"] = lambda: replay_steps(KVCacheManager(layout, enable_kv_events=True, **AS_THE_ENGINE),
                                                          trace, take_events=True)
            if args.wide_block and any(isinstance(g.spec, RecurrentSpec) for g in layout.groups):
                wide_layout = plan_layout(specs, args.memory, args.wide_block)
                variants["wide"] = lambda: replay_steps(KVCacheManager(wide_layout, **AS_THE_ENGINE), trace)
            if vllm_replay is not None:
                variants["vllm"] = lambda: vllm_replay.run_steps(path, trace, args.memory)
            runs = harness.lockstep(variants, args.repeat, turn=TURN)
            rounds = {variant: fastest(variant_runs) for variant, variant_runs in runs.items()}
            row = {"model": label, "trace": name, "groups": len(layout.groups), "block_size": layout.block_size,
                   **rounds["hybridkv"]}
            tables["models"].append(row)
            print(f"{label:<26} {name:<14} {row['groups']:>6} {row['us_per_admission']:>13.1f} "
                  f"{row['us_per_decode_step']:>15.2f} {row['us_per_failed_admission']:>15.1f} {row['preemptions']:>8} "
                  f"{row['peak_pages']:>11,} {row['hit_tokens']:>11,} {row['hit_rate']:>9.1%}")
            if "events" in rounds:
                on = rounds["events"]
                events.append({"model": label, "trace": name, "off": rounds["hybridkv"], "on": on,
                               "admission_change": on["us_per_admission"] / row["us_per_admission"] - 1,
                               "decode_change": on["us_per_decode_step"] / row["us_per_decode_step"] - 1})
            if "vllm" in rounds:
                them = rounds["vllm"]
                theirs.append({"model": label, "trace": name, **them, "version": vllm_version,
                               **against_vllm(runs, "hybridkv")})
                if name == names[0]:
                    notes.append(f"  {label}: {vllm_replay.describe(them)}")
            if "wide" in rounds:
                wide.append({"model": label, "trace": name, "block_size": args.wide_block, **rounds["wide"],
                             **({"vs_vllm": against_vllm(runs, "wide")} if "vllm" in runs else {})})
    if events:
        print_events(events)
        tables["events"] = events
    if theirs:
        print_vllm(vllm_version, theirs, notes)
        tables["vllm"] = theirs
    if wide:
        print_wide(wide)
        tables["wide"] = wide
    print("\nper decode step vs pool size and context (8 requests x 256 steps, fastest round)")
    print(f"{'model':<26} {'pool pages':>11} {'context':>8} {'us/decode step':>15}")
    for label, file in CONFIGS.items():
        specs = specs_from_config(load_config(os.path.join(MODELS_DIR, file)))
        # the fastest of `--repeat` rounds per cell: one cell is a few ms, which one pause can spoil
        for row in map(fastest, zip(*(scaling(specs, args.quick) for _ in range(args.repeat)))):
            tables["scaling"].append({"model": label, **row})
            print(f"{label:<26} {row['pool_pages']:>11,} {row['context']:>8,} {row['us_per_decode_step']:>15.2f}")
    return tables


if __name__ == "__main__":
    harness.main(run, arguments, repeat=2)
