"""Routing requests over N replicas, by simulation: the prefix hit each
router gets, against one cache as big as all replicas together.

Every replica is a real KVCacheManager (no model): a request's prefill is
its allocation and `mark_computed` at admission, its decode one token per
step, as the engine's scheduler drives the manager. The hit a request gets
is the one its replica's manager gives (`get_computed_tokens`), never an
estimate. Routers compared on the same arrivals:

* round robin     each request to the next replica in turn;
* token prefix    what llm-d's KV cache indexer, Dynamo's KV router and Ray
                  Serve's prefix-aware router compute: the longest run of
                  leading blocks whose keys the replica holds, as if every
                  layer were full attention (here: the full-attention
                  group's keys, fed by the replicas' KV events; it cannot
                  see whether a window tail or a Mamba checkpoint is there),
                  then the routing rule below on that estimate;
* hybrid (hit only)  hybridkv's router on the hit alone: a PrefixIndex
                  fed by every replica's `take_events()` after every step,
                  the hit by the manager's own rule (`index.best`), then the
                  routing rule on that hit;
* hybrid          the same, and the rule's affinity credit for the leading
                  blocks a replica holds past its hit (the token-prefix
                  view, as a second signal): without it a Mamba model's
                  prompt families scatter once their checkpoints are gone
                  (hybridkv/core/routing.py says why; the table shows it);
* single cache    the bound: one manager with N times the pool (and N times
                  the batch and prefill rate) serving everything. Not a
                  strict one: at N times the prefill rate it admits a
                  family's requests that arrive together at once, before
                  the first has stored anything, where one replica's queue
                  would have served them in turn, the later ones hitting.

The routing rule (hybridkv/core/routing.py) charges a replica the prompt
tokens it must compute plus `queued_request_tokens` per request it has
beyond the least busy replica (waiting or running), less 0.25 per token it
holds past its hit where the router says so: a replica d requests
busier than the least busy one must offer a hit more than
d * queued_request_tokens tokens longer to win. The sweep over
queued_request_tokens (0, 64, 256, 1024) shows what that price buys in hit
and costs in balance.

The hybrid router's predicted hit is checked against the chosen replica's
real hit at the moment of routing (events applied after every step, so the
index is current): they must be equal, and the run stops if they are not.
On the hybrid routers' own states, the replica a token-prefix router would
have picked is found too, and its real hit (exact, from the index) is
reported beside ("tp pick"): the two compared decision by decision. A
decision's time includes hashing the prompt (the hybrid router hashes it a
second time for the leading runs its affinity credit reads).

Workload (seeded; the same arrivals for every router). Sessions start as a
Poisson process; a step is one decode iteration (about 30 ms on the GPUs
the default pools stand for):
* document questions (35% of sessions): one of 8 shared system prompts
  (300-2,000 tokens, Zipf popularity) + one of 3 x N documents (2,000-10,000
  tokens, Zipf popularity s=1.1) + a question (20-200 tokens);
* chats (45%): a system prompt (or, one time in four, system prompt and a
  document) and 2-10 turns; each turn's prompt is the whole history (every
  earlier message and answer) plus a new message (30-400 tokens); the next
  turn arrives a think time after the answer should be done (exponential,
  mean 600 steps, about 20 s), so a conversation comes back after other
  traffic has passed through the caches;
* one-off requests (20%): a system prompt + 100-1,500 unique tokens.
Answers are 20-300 tokens. A replica admits waiting requests first come,
first served while it has fewer than `max_running` running, pages for the
whole prompt, and prefill budget (512 tokens a step, carried over as a debt
for a long prompt: a request decodes once its prefill is paid for). A
request that finds no page for a decode step preempts the newest one
(recompute). Blocks are marked computed at admission, so they can be hit a
few steps before a real engine would have finished writing them.

Pools (--memory overrides all): what a replica has for KV beside the bf16
weights on the GPUs it plausibly runs on. Gemma-3-27B: 16 GiB (one 80 GB
GPU, 54 GB of weights); Jamba-1.5-Mini: 32 GiB (two 80 GB GPUs, 104 GB of
weights); Llama-3.1-8B, the full-attention control where the token-prefix
router and the hybrid router must agree: 6 GiB (one 24 GB GPU, 16 GB of
weights).

    python -m benchmarks.replica_routing                 # 64 replicas, all layouts, the sweep
    python -m benchmarks.replica_routing --replicas 16 --requests 4000
    python -m benchmarks.replica_routing --quick         # seconds, for CI
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

from benchmarks import harness
from hybridkv.core import KVCacheManager, parse_memory, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.core.prefix_index import PrefixIndex
from hybridkv.core.routing import RoutingRule

MODELS = os.path.join(harness.ROOT, "models")
LAYOUTS = {  # label -> (config file, KV pool per replica)
    "Gemma-3-27B": ("gemma-3-27b.json", "16GiB"),
    "Jamba-1.5-Mini": ("jamba-1.5-mini.json", "32GiB"),
    "Llama-3.1-8B (full only)": ("llama-3.1-8b.json", "6GiB"),
}
ROUTERS = ("single cache", "round robin", "token prefix", "hybrid (hit only)", "hybrid")
SWEEP = (0, 64, 256, 1024)


# -- the workload -------------------------------------------------------------

@dataclass
class Arrival:
    step: int
    family: str
    prompt: list
    answer: list


@dataclass
class WorkloadShape:
    """Lengths (tokens) and mix of the workload; `small()` scales it for tests."""
    systems: int = 8
    system_len: tuple = (300, 2000)
    docs_per_replica: int = 3
    doc_len: tuple = (2000, 10000)
    question_len: tuple = (20, 200)
    message_len: tuple = (30, 400)
    answer_len: tuple = (20, 300)
    one_off_len: tuple = (100, 1500)
    turns: tuple = (2, 10)
    think_steps: float = 600.0
    mix: tuple = (("doc", 0.35), ("chat", 0.45), ("one-off", 0.20))

    def small(self, factor: float) -> "WorkloadShape":
        scale = lambda pair: (max(1, int(pair[0] * factor)), max(2, int(pair[1] * factor)))  # noqa: E731
        return WorkloadShape(self.systems, scale(self.system_len), self.docs_per_replica, scale(self.doc_len),
                             scale(self.question_len), scale(self.message_len), scale(self.answer_len),
                             scale(self.one_off_len), self.turns, self.think_steps * factor, self.mix)


def _zipf_picker(rng: random.Random, n: int, s: float):
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** s for rank in range(n)))
    return lambda: bisect.bisect(cumulative, rng.random() * cumulative[-1])


def make_workload(num_requests: int, replicas: int, requests_per_replica_step: float, seed: int = 0,
                  shape: WorkloadShape | None = None) -> list[Arrival]:
    """The arrivals, in step order (see the module docstring)."""
    shape = shape or WorkloadShape()
    rng = random.Random(seed)
    words = lambda bounds: [rng.randrange(3, 32000) for _ in range(rng.randint(*bounds))]  # noqa: E731
    systems = [words(shape.system_len) for _ in range(shape.systems)]
    docs = [words(shape.doc_len) for _ in range(shape.docs_per_replica * replicas)]
    pick_system = _zipf_picker(rng, len(systems), 1.0)
    pick_doc = _zipf_picker(rng, len(docs), 1.1)
    kinds, weights = zip(*shape.mix)
    mean_turns = sum(shape.turns) / 2
    per_session = sum(w * (mean_turns if k == "chat" else 1) for k, w in shape.mix)
    session_rate = requests_per_replica_step * replicas / per_session  # sessions a step
    mean_answer = sum(shape.answer_len) / 2
    out: list[Arrival] = []
    turns_due: list = []  # heap of (step, tie, history, turns left)
    clock = 0.0
    tie = itertools.count()
    while len(out) < num_requests:
        clock += rng.expovariate(session_rate)
        while turns_due and turns_due[0][0] <= clock and len(out) < num_requests:
            step, _, history, left = heapq.heappop(turns_due)
            _chat_turn(out, turns_due, rng, words, shape, step, history, left, mean_answer, tie)
        if len(out) >= num_requests:
            break
        kind = rng.choices(kinds, weights)[0]
        system = systems[pick_system()]
        if kind == "doc":
            out.append(Arrival(int(clock), kind, system + docs[pick_doc()] + words(shape.question_len),
                               words(shape.answer_len)))
        elif kind == "one-off":
            out.append(Arrival(int(clock), kind, system + words(shape.one_off_len), words(shape.answer_len)))
        else:
            history = system + docs[pick_doc()] if rng.random() < 0.25 else list(system)
            _chat_turn(out, turns_due, rng, words, shape, clock, history, rng.randint(*shape.turns), mean_answer,
                       tie)
    out.sort(key=lambda a: a.step)
    return out


def _chat_turn(out, turns_due, rng, words, shape, step, history, left, mean_answer, tie) -> None:
    prompt = history + words(shape.message_len)
    answer = words(shape.answer_len)
    out.append(Arrival(int(step), "chat", prompt, answer))
    if left > 1:
        due = step + mean_answer + rng.expovariate(1.0 / shape.think_steps)
        heapq.heappush(turns_due, (due, next(tie), prompt + answer, left - 1))


# -- the routers --------------------------------------------------------------

class RoundRobin:
    name = "round robin"
    exact = False
    needs_events = False

    def __init__(self, replicas: int):
        self.replicas = replicas
        self._next = 0

    def route(self, tokens, loads) -> tuple[int, int]:
        choice = self._next
        self._next = (choice + 1) % self.replicas
        return choice, 0

    def observe(self, replica, events) -> None:
        pass


class TokenPrefixRouter:
    name = "token prefix"
    exact = False
    needs_events = True

    def __init__(self, layout, replicas: int, rule: RoutingRule):
        self.index = PrefixIndex(layout)  # of which it reads the full-attention keys only
        self.replicas = list(range(replicas))
        self.rule = rule

    def route(self, tokens, loads) -> tuple[int, int]:
        keys, _ = self.index.block_keys(tokens)
        hits = self.index.held_tokens(keys)
        choice = self.rule.choose(len(tokens), self.replicas, hits, loads)
        return choice, hits.get(choice, 0)

    def observe(self, replica, events) -> None:
        self.index.apply(replica, events)


class HybridRouter:
    """hybridkv's router: the exact hit from a PrefixIndex; with `held`, the
    routing rule also credits the leading blocks a replica holds past that
    hit (RoutingRule's affinity: where a family's next computation leaves
    the checkpoint its later requests hit)."""
    exact = True  # its prediction must equal the manager's hit
    needs_events = True

    def __init__(self, layout, replicas: int, rule: RoutingRule, held: bool = True):
        self.name = "hybrid" if held else "hybrid (hit only)"
        self.index = PrefixIndex(layout)  # its leading runs: the affinity signal, and the token-prefix pick
        self.use_held = held
        self.replicas = list(range(replicas))
        self.rule = rule
        self._shadow = RoutingRule(rule.queued_request_tokens, 0.0)  # the token-prefix router's rule
        self._last = None

    def route(self, tokens, loads) -> tuple[int, int]:
        keys = self.index.block_keys(tokens)[0]  # hashed once, for the hit and the held runs
        hits = {replica: hit for hit, replica in self.index.best_of_keys(keys)}
        held = self.index.held_tokens(keys) if self.use_held else None
        choice = self.rule.choose(len(tokens), self.replicas, hits, loads, held)
        self._last = (len(tokens), keys, hits, held, choice)
        return choice, hits.get(choice, 0)

    def token_prefix_pick(self, loads) -> tuple[int, int]:
        """For the request just routed: the hit at the replica a token-prefix
        router would have picked on the same state (its own rule, same queue
        price), and the hit at ours. Exact: the index gives every replica's
        real hit. Outside the timed decision."""
        prompt_tokens, keys, hits, held, choice = self._last
        if held is None:
            held = self.index.held_tokens(keys)
        pick = self._shadow.choose(prompt_tokens, self.replicas, held, loads)
        return hits.get(pick, 0), hits.get(choice, 0)

    def observe(self, replica, events) -> None:
        self.index.apply(replica, events)


# -- the replicas -------------------------------------------------------------

@dataclass
class Job:
    rid: str
    arrival: int
    tokens: list  # what the manager holds for it: the prompt, plus the answer so far after a preemption
    answer: list
    done: int = 0  # answer tokens decoded
    start: int = 0  # first decode step (its prefill paid for)
    admitted: bool = False


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # taken at admission
    hit_at_routing: int = 0
    predicted_tokens: int = 0
    misroutes: int = 0
    misrouted_tokens: int = 0
    checked: int = 0  # predictions checked equal to the real hit (hybrid)
    token_pick_hit: int = 0  # hybrid: hit tokens at the replicas a token-prefix router would have picked
    token_pick_longer: int = 0  # hybrid: decisions where that pick had the longer hit
    token_pick_shorter: int = 0  # hybrid: ... the shorter hit
    decide_s: float = 0.0
    events_s: float = 0.0
    steps: int = 0
    wait_steps: list = field(default_factory=list)
    preemptions: int = 0


class Replica:
    """One engine's KV cache with its queue: first come, first served
    admission within a prefill budget per step, one decode token per
    running request per step."""

    def __init__(self, layout, max_running: int, prefill_per_step: int, events: bool, totals: Totals):
        self.kv = KVCacheManager(layout, enable_kv_events=events)
        self.max_running = max_running
        self.prefill_per_step = prefill_per_step
        self.credit = prefill_per_step
        self.waiting: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.routed = 0
        self.totals = totals
        self._restarts = itertools.count()

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, now: int) -> None:
        self._admit(now)
        self._decode(now)

    def _admit(self, now: int) -> None:
        kv, budget = self.kv, self.prefill_per_step
        self.credit = min(budget, self.credit + budget)
        while self.waiting and self.credit > 0 and len(self.running) < self.max_running:
            job = self.waiting[0]
            if job.rid not in kv:
                kv.add_request(job.rid, job.tokens)
            hit = kv.get_computed_tokens(job.rid)
            if not _prefill(kv, job.rid):
                kv.free(job.rid)  # nothing kept: it is looked up again when pages free up
                if not self.running:
                    raise RuntimeError(f"a request of {len(job.tokens)} tokens does not fit one replica's pool: "
                                       "raise --memory")
                return
            self.waiting.popleft()
            if not job.admitted:
                job.admitted = True
                t = self.totals
                t.hit_tokens += hit
                t.wait_steps.append(now - job.arrival)
            self.credit -= len(job.tokens) - hit
            job.start = now + 1 + max(0, math.ceil(-self.credit / budget))
            self.running[job.rid] = job

    def _decode(self, now: int) -> None:
        ids = [rid for rid, job in self.running.items() if job.start <= now]
        if not ids:
            return
        kv = self.kv
        tokens = [self.running[rid].answer[self.running[rid].done] for rid in ids]
        kv.append_token_ids_many(ids, tokens)
        preempted = []
        done = 0
        while done < len(ids):
            done += kv.allocate_slots_many(ids[done:] if done else ids, 1)
            if done < len(ids):  # out of pages: the newest request goes back to the queue
                victim = ids.pop()
                tokens.pop()
                kv.free(victim)
                preempted.append(victim)
        kv.mark_computed_many(ids, 1)
        for rid in ids:
            job = self.running[rid]
            job.done += 1
            if job.done == len(job.answer):
                kv.free(rid)
                del self.running[rid]
        for rid in reversed(preempted):
            job = self.running.pop(rid)
            job.tokens = job.tokens + job.answer[:job.done]
            job.rid = f"{job.rid.split('~')[0]}~{next(self._restarts)}"
            self.waiting.appendleft(job)
            self.totals.preemptions += 1


def _prefill(kv: KVCacheManager, rid: str) -> bool:
    """Allocate and mark computed the whole prompt, chunk by chunk up to
    each Mamba checkpoint; False if the pool has no room now."""
    total = kv.num_tokens(rid)
    while kv.num_computed_tokens(rid) < total:
        size = kv.next_chunk(rid, total)
        if not kv.allocate_slots(rid, size):
            return False
        kv.mark_computed(rid, size)
    return True


# -- the simulation -----------------------------------------------------------

def simulate(layout, workload: list[Arrival], router, replicas: int, max_running: int = 64,
             prefill_per_step: int = 512) -> dict:
    """Serve `workload` on `replicas` managers of `layout`, each request sent
    where `router` says; returns the totals (see the module docstring)."""
    totals = Totals()
    fleet = [Replica(layout, max_running, prefill_per_step, router.needs_events, totals) for _ in range(replicas)]
    perf = time.perf_counter
    started = perf()
    now = 0
    pending = deque(workload)
    busy: set[int] = set()
    while pending or busy:
        if not busy and pending[0].step > now:
            now = pending[0].step  # nothing to do until the next arrival
        while pending and pending[0].step <= now:
            arrival = pending.popleft()
            loads = {i: fleet[i].load for i in busy}
            t0 = perf()
            choice, predicted = router.route(arrival.prompt, loads)
            totals.decide_s += perf() - t0
            if router.exact:
                theirs, ours = router.token_prefix_pick(loads)
                totals.token_pick_hit += theirs
                totals.token_pick_longer += theirs > ours
                totals.token_pick_shorter += theirs < ours
            _place(fleet[choice], arrival, totals, predicted, router.exact)
            busy.add(choice)
        for i in list(busy):
            replica = fleet[i]
            replica.step(now)
            if not replica.load:
                busy.discard(i)
        if router.needs_events:
            t0 = perf()
            for i, replica in enumerate(fleet):
                events = replica.kv.take_events()
                if events:
                    router.observe(i, events)
            totals.events_s += perf() - t0
        now += 1
        totals.steps += 1
    return _summary(totals, fleet, perf() - started)


def _place(replica: Replica, arrival: Arrival, totals: Totals, predicted: int, exact: bool) -> None:
    """Queue the request on its replica, and compare the router's predicted
    hit with the real one the replica's manager gives now."""
    rid = f"r{totals.requests}"
    totals.requests += 1
    totals.prompt_tokens += len(arrival.prompt)
    replica.kv.add_request(rid, arrival.prompt)
    real = replica.kv.get_computed_tokens(rid)
    totals.hit_at_routing += real
    totals.predicted_tokens += predicted
    if real < predicted:
        totals.misroutes += 1
        totals.misrouted_tokens += predicted - real
    if exact:
        if real != predicted:
            raise AssertionError(f"request {rid}: the router predicted a hit of {predicted} tokens, "
                                 f"the replica's manager gives {real}")
        totals.checked += 1
    replica.routed += 1
    replica.waiting.append(Job(rid, arrival.step, arrival.prompt, arrival.answer))


def _summary(t: Totals, fleet: list[Replica], seconds: float) -> dict:
    routed = [r.routed for r in fleet]
    evicted: dict[str, int] = {}
    for replica in fleet:
        stats = replica.kv.stats
        for reason in ("lru", "probation"):  # for want of room (a superseded checkpoint is not)
            for kind, n in zip(stats.group_kinds, stats.evictions_by_reason[reason]):
                evicted[kind] = evicted.get(kind, 0) + n
    waits = sorted(t.wait_steps)
    return {
        "requests": t.requests, "prompt_tokens": t.prompt_tokens, "hit_tokens": t.hit_tokens,
        "hit_rate": t.hit_tokens / t.prompt_tokens, "hit_rate_at_routing": t.hit_at_routing / t.prompt_tokens,
        "predicted_tokens": t.predicted_tokens, "misroutes": t.misroutes, "misroute_rate": t.misroutes / t.requests,
        "misrouted_tokens": t.misrouted_tokens, "predictions_checked": t.checked,
        "hit_rate_at_token_prefix_pick": t.token_pick_hit / t.prompt_tokens,
        "token_prefix_pick_longer": t.token_pick_longer,
        "token_prefix_pick_shorter": t.token_pick_shorter,
        "imbalance": max(routed) / (sum(routed) / len(routed)),
        "us_per_decision": 1e6 * t.decide_s / t.requests, "ms_events_per_step": 1e3 * t.events_s / max(1, t.steps),
        "mean_wait_steps": sum(waits) / len(waits), "p95_wait_steps": waits[int(0.95 * (len(waits) - 1))],
        "preemptions": t.preemptions, "evicted_keys": evicted, "steps": t.steps, "seconds": seconds,
    }


def make_router(name: str, layout, replicas: int, queued_request_tokens: int = 256):
    rule = RoutingRule(queued_request_tokens)
    if name == "round robin":
        return RoundRobin(replicas)
    if name == "token prefix":
        return TokenPrefixRouter(layout, replicas, rule)
    if name in ("hybrid", "hybrid (hit only)"):
        return HybridRouter(layout, replicas, rule, held=name == "hybrid")
    raise ValueError(f"unknown router {name!r}")


def run_router(name: str, layout, single_layout, workload, replicas: int, max_running: int, prefill_per_step: int,
               queued_request_tokens: int = 256) -> dict:
    """One row: `name` routing over `replicas` replicas, or the single cache."""
    if name == "single cache":
        return simulate(single_layout, workload, RoundRobin(1), 1, max_running * replicas,
                        prefill_per_step * replicas)
    router = make_router(name, layout, replicas, queued_request_tokens)
    return simulate(layout, workload, router, replicas, max_running, prefill_per_step)


# -- the report ---------------------------------------------------------------

def print_row(label: str, row: dict, single: dict | None) -> None:
    vs = f"{row['hit_tokens'] / single['hit_tokens']:>8.1%}" if single and single["hit_tokens"] else f"{'':>8}"
    evicted = row["evicted_keys"]
    partial = sum(n for kind, n in evicted.items() if kind != "full")
    pick = f"{row['hit_rate_at_token_prefix_pick']:>8.1%}" if row["predictions_checked"] else f"{'':>8}"
    print(f"{label:<22} {row['hit_rate']:>8.1%} {vs} {row['hit_tokens']:>13,} {pick} {row['misroute_rate']:>9.1%} "
          f"{row['imbalance']:>9.2f} {row['mean_wait_steps']:>6.1f} {row['p95_wait_steps']:>5} "
          f"{row['us_per_decision']:>8.0f} {row['ms_events_per_step']:>8.2f} {partial:>10,} {row['seconds']:>6.0f}")


HEADER = (f"{'router':<22} {'hit rate':>8} {'vs one':>8} {'saved tokens':>13} {'tp pick':>8} {'misroutes':>9} "
          f"{'max/mean':>9} "
          f"{'wait':>6} {'p95':>5} {'us/dec.':>8} {'ms ev/st':>8} {'win/ckpt ev':>10} {'sim s':>6}")


def arguments(parser) -> None:
    parser.add_argument("--replicas", type=int, default=64, help="(--quick: 8, a short trace, short prompts)")
    parser.add_argument("--requests", type=int, default=None, help="default: 150 per replica")
    parser.add_argument("--rate", type=float, default=0.12,
                        help="arrivals per replica per step (a step: one decode iteration)")
    parser.add_argument("--memory", default=None, help="KV pool per replica for every layout (default: per layout)")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--prefill-per-step", type=int, default=512, help="prefill tokens a replica computes a step")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, from: " + ", ".join(LAYOUTS))
    parser.add_argument("--sweep", default=",".join(map(str, SWEEP)),
                        help="queued_request_tokens values for the hybrid router ('' for none)")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> dict:
    shape = WorkloadShape()
    if args.quick:
        args.replicas, args.requests = 8, args.requests or 300
        shape = shape.small(0.25)
    num = args.requests or 150 * args.replicas
    sweep = [int(v) for v in args.sweep.split(",") if v.strip()]
    workload = make_workload(num, args.replicas, args.rate, args.seed, shape)
    prompt_tokens = sum(len(a.prompt) for a in workload)
    families = {f: sum(a.family == f for a in workload) for f, _ in shape.mix}
    print(f"{args.replicas} replicas, {num:,} requests over {workload[-1].step:,} steps, "
          f"{prompt_tokens / num:,.0f} prompt tokens a request on average "
          f"({', '.join(f'{n:,} {f}' for f, n in families.items())}); "
          f"prefill {args.prefill_per_step} tokens/step, up to {args.max_running} running per replica")
    tables: dict = {"workload": [{"replicas": args.replicas, "requests": num, "prompt_tokens": prompt_tokens,
                                  "steps": workload[-1].step, **families}],
                    "layouts": [], "routers": [], "sweep": []}
    for label in args.layouts.split(","):
        label = label.strip()
        file, memory = LAYOUTS[label]
        memory = args.memory or memory
        specs = specs_from_config(load_config(os.path.join(MODELS, file)))
        layout = plan_layout(specs, memory)
        single_layout = plan_layout(specs, parse_memory(memory) * args.replicas)
        print(f"\n{label}: {memory} of KV per replica ({layout.num_pages:,} pages), groups "
              f"{', '.join(g.kind for g in layout.groups)}")
        print(HEADER)
        rows: dict = {}
        for name in ROUTERS:
            rows[name] = run_router(name, layout, single_layout, workload, args.replicas, args.max_running,
                                    args.prefill_per_step)
            print_row(name, rows[name], rows["single cache"])
        sweep_rows = {}
        for value in sweep:
            if value == 256:
                sweep_rows[value] = rows["hybrid"]
            else:
                sweep_rows[value] = run_router("hybrid", layout, single_layout, workload, args.replicas,
                                               args.max_running, args.prefill_per_step, value)
        if sweep:
            print("hybrid router, queued_request_tokens swept:")
            for value, row in sweep_rows.items():
                print_row(f"  {value} tokens/request", row, rows["single cache"])
        single, hybrid, token = (rows[k]["hit_tokens"] for k in ("single cache", "hybrid", "token prefix"))
        verdict = {"hybrid_vs_single": hybrid / single if single else None,
                   "hybrid_vs_token_prefix": hybrid / token if token else None,
                   "hybrid_predictions_checked": rows["hybrid"]["predictions_checked"]}
        print(f"hybrid router: {verdict['hybrid_vs_single']:.1%} of the single cache's saved tokens, "
              f"{verdict['hybrid_vs_token_prefix']:.2f}x the token-prefix router's; "
              f"{verdict['hybrid_predictions_checked']:,} predicted hits equal the replicas' real ones")
        tables["layouts"].append({"layout": label, "memory": memory, "pages": layout.num_pages, **verdict})
        tables["routers"] += [{"layout": label, "router": name, **row} for name, row in rows.items()]
        tables["sweep"] += [{"layout": label, "queued_request_tokens": value, **row}
                            for value, row in sweep_rows.items()]
    print("\nhit rate: prompt tokens served from the cache (the hit the replica's manager gave at admission) / "
          "prompt tokens; vs one: saved tokens / the single cache's; tp pick: on the hybrid router's states, the hit "
          "rate at the replicas a token-prefix router would have picked (at routing); misroutes: requests whose "
          "replica's real hit was shorter than the router predicted; max/mean: requests routed to the busiest "
          "replica / the mean; wait, p95: steps from arrival to admission; us/dec.: router time per request; "
          "ms ev/st: applying events per step; win/ckpt ev: window and Mamba keys evicted for want of room")
    return tables


if __name__ == "__main__":
    harness.main(run, arguments)
