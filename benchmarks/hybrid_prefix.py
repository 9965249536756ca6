"""Hybrid prefix caching: Mamba checkpoint policies on a multi-turn chat trace.

A Mamba layer can only resume from a saved state, and every saved state costs
a whole state (16 MB for Jamba-1.5-Mini's 28 Mamba layers, the memory of
~1,000 tokens of its attention KV). Which positions to save decides the hit
rate. This replays a seeded chat trace through KVCacheManager alone (no
model) on the Jamba-1.5-Mini config at one KV budget, once per policy:

* every_block  a checkpoint at every block boundary (prompt and decode)
* prompt_end   only at the end of each prompt
* hybridkv     the project's rule: prompt end, branch points shared with other requests,
               and a rolling end-of-sequence checkpoint (core/checkpoints.py)

Trace: conversations of 2-8 turns, each turn the whole history plus a new
user message; a few shared system prompts; a fifth of the conversations
branch from another's history. A turn arrives a think time after the
previous one of its conversation finished (5-60 other requests arrive
meanwhile); up to 32 requests run at once. Reported: token hit rate (prompt tokens served
from the cache) and the prefill tokens not recomputed.

    python -m benchmarks.hybrid_prefix [--quick] [--budgets 2GiB,4GiB,8GiB,16GiB]
"""

from __future__ import annotations

import os
import random
import time

from benchmarks import harness
from hybridkv.core import KVCacheManager, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config

MODELS = os.path.join(harness.ROOT, "models")
POLICIES = ("every_block", "prompt_end", "hybridkv")


def make_conversations(num: int, seed: int = 0):
    """Each conversation: (system prompt, [(user message, response)] per turn),
    some sharing the first turns of an earlier conversation."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, 32000) for _ in range(n)]  # noqa: E731
    systems = [words(rng.randint(200, 500)) for _ in range(4)]
    conversations = []
    for i in range(num):
        if conversations and rng.random() < 0.2:
            base_system, base_turns = rng.choice(conversations)
            keep = rng.randint(1, len(base_turns))
            turns = list(base_turns[:keep])
            system = base_system
        else:
            system, turns = rng.choice(systems), []
        for _ in range(rng.randint(2, 8) - len(turns) if len(turns) < 8 else 0):
            turns.append((words(rng.randint(20, 200)), words(rng.randint(50, 300))))
        conversations.append((system, turns))
    return conversations


def replay(kv: KVCacheManager, conversations, max_running: int = 32, chunk: int = 2048, seed: int = 1) -> dict:
    """Conversations start in order, up to `max_running` requests at once; a
    turn's request is its history plus the new message; its response is
    decoded one token per step; the next turn arrives after the user's
    think time, during which 5-60 other requests arrive."""
    think = random.Random(seed)
    pending = [(c, 0) for c in range(len(conversations))]  # (conversation, turn) ready to arrive
    pending.reverse()
    running: dict[str, list] = {}
    hit_tokens = prompt_tokens = 0
    rid_counter = 0
    history: dict[int, list[int]] = {}
    while pending or running:
        while pending and len(running) < max_running:
            conv, turn = pending[-1]
            system, turns = conversations[conv]
            user, response = turns[turn]
            prompt = history.get(conv, list(system)) + user
            rid = f"c{conv}t{turn}#{rid_counter}"
            kv.add_request(rid, prompt)
            hit = kv.get_computed_tokens(rid)
            ok = True
            while kv.num_computed_tokens(rid) < len(prompt) or not kv._requests[rid].started:
                size = kv.next_chunk(rid, chunk)
                if not kv.allocate_slots(rid, size):
                    ok = False
                    break
                kv.mark_computed(rid, size)
            if not ok:
                kv.free(rid)
                if not running:
                    raise RuntimeError("one request does not fit the budget")
                break
            rid_counter += 1
            pending.pop()
            prompt_tokens += len(prompt)
            hit_tokens += hit
            running[rid] = [conv, turn, prompt, list(response), 0]
        finished = []
        for rid, state in running.items():
            conv, turn, prompt, response, done = state
            kv.append_token_ids(rid, [response[done]])
            if not kv.allocate_slots(rid, 1):
                raise RuntimeError("decode ran out of pages: raise the budget")
            kv.mark_computed(rid, 1)
            state[4] += 1
            if state[4] == len(response):
                finished.append(rid)
        for rid in finished:
            conv, turn, prompt, response, _ = running.pop(rid)
            kv.free(rid)
            history[conv] = prompt + response
            if turn + 1 < len(conversations[conv][1]):
                pending.insert(max(0, len(pending) - think.randint(5, 60)), (conv, turn + 1))
    return {"requests": rid_counter, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
            "hit_rate": hit_tokens / prompt_tokens, "evictions": kv.stats.evictions}


def arguments(parser) -> None:
    parser.add_argument("--conversations", type=int, default=400, help="(--quick: 40, one budget)")
    parser.add_argument("--budgets", default="2GiB,4GiB,8GiB,16GiB", help="KV budgets, comma-separated")
    parser.add_argument("--model", default="jamba-1.5-mini.json")


def run(args) -> dict:
    num = 40 if args.quick else args.conversations
    budgets = args.budgets.split(",")[:1 if args.quick else None]
    conversations = make_conversations(num)
    specs = specs_from_config(load_config(os.path.join(MODELS, args.model)))
    rows = []
    for budget in budgets:
        layout = plan_layout(specs, budget, block_size=16)  # the block of its recorded runs
        mamba = next(g for g in layout.groups if g.recurrent)
        state_mib = mamba.pages_per_block * layout.page_size_bytes / 2**20
        print(f"{args.model}, KV budget {budget} ({layout.num_pages:,} pages; one Mamba state = {state_mib:.1f} MiB), "
              f"{num} conversations")
        print(f"{'policy':<12} {'requests':>8} {'prompt tokens':>14} {'hit tokens':>11} {'hit rate':>9} "
              f"{'evictions':>10} {'seconds':>8}")
        results = {}
        for policy in POLICIES:
            kv = KVCacheManager(layout, checkpoint_policy=policy)
            start = time.perf_counter()
            row = replay(kv, conversations)
            row["seconds"] = time.perf_counter() - start
            results[policy] = row
            print(f"{policy:<12} {row['requests']:>8} {row['prompt_tokens']:>14,} {row['hit_tokens']:>11,} "
                  f"{row['hit_rate']:>9.1%} {row['evictions']:>10,} {row['seconds']:>8.1f}")
        base, ours = results["every_block"], results["hybridkv"]
        ratio = ours["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("inf")
        print(f"hybridkv's rule vs every-block checkpointing: {ratio:.1f}x the token hit rate; "
              f"{ours['hit_tokens']:,} prefill tokens not recomputed "
              f"({ours['hit_tokens'] - base['hit_tokens']:+,} vs every block)\n")
        rows.append({"budget": budget, "state_mib": state_mib, **results, "ratio_vs_every_block": ratio})
    return {"budgets": rows}


if __name__ == "__main__":
    harness.main(run, arguments)
