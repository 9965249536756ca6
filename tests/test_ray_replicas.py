"""Engine replicas on Ray Serve (hybridkv/serving/ray.py): each request goes
to the replica with the longest hybrid hit, outputs equal one plain
Engine's, a killed replica is replaced and no request is lost.

One local Ray and two applications (tiny Gemma-3, tiny Jamba; two replicas
each) serve every test of the module. Which replica answered comes back in
the x-hybridkv-replica header.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

from ray import serve  # noqa: E402

from hybridkv.core.events import AllBlocksCleared  # noqa: E402
from hybridkv.core.prefix_index import PrefixIndex  # noqa: E402
from hybridkv.engine import Engine, SamplingParams  # noqa: E402
from hybridkv.server.protocol import render_chat  # noqa: E402
from hybridkv.kv_events.feed import EventReporter, IndexFeed, RecentRoutes, snapshot_events  # noqa: E402
from hybridkv.serving.ray import REPLICA_HEADER, build_application, start_ray, stop_local_ray  # noqa: E402
from hybridkv.tiny_models import tiny_model_dir  # noqa: E402
from serving import free_port  # noqa: E402

# Gemma-3's pool is small on purpose: 61 pages, so a second long prompt on a
# replica evicts the sliding-window blocks the first one released early.
OPTIONS = {"tiny-gemma3": dict(kv_cache_memory="248KiB", max_num_seqs=4, max_num_batched_tokens=256),
           "tiny-jamba": dict(kv_cache_memory="8MiB", max_num_seqs=4, max_num_batched_tokens=256, block_size=16)}
STATS_PERIOD_S = 0.2
SETTLE_S = 1.0  # a few report periods: long enough for the routers to hear of what the replicas cached


@pytest.fixture(scope="module")
def cluster():
    start_ray(num_cpus=8, log_to_driver=False)  # room for the applications below at once (logical CPUs)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name in OPTIONS:
        app = build_application(tiny_model_dir(name), model_name=name, num_replicas=2, engine_options=OPTIONS[name],
                                stats_period_s=STATS_PERIOD_S, snapshot_every=5, health_check_period_s=1.0)
        serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
    for name in OPTIONS:
        _wait_running(name)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    yield client
    client.close()
    stop_local_ray()  # with Ray's agents, which outlive ray.shutdown()


def _wait_running(app: str, replicas: int = 2, timeout: float = 120, deployment: str = "EngineReplica") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            engines = status.deployments[deployment]
            if engines.replica_states.get("RUNNING", 0) == replicas and len(engines.replica_states) == 1:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{app} did not get {replicas} running engine replicas: {serve.status()}")


@pytest.fixture(scope="module")
def plain():
    """One plain engine per model: the oracle."""
    engines = {}

    def get(name):
        if name not in engines:
            engines[name] = Engine(tiny_model_dir(name), **OPTIONS[name])
        return engines[name]

    return get


def complete(client, app, prompt, max_tokens=4, **extra):
    r = client.post(f"/{app}/v1/completions",
                    json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.headers[REPLICA_HEADER], body["choices"][0]["text"], cached


def greedy(engine, prompt_ids, max_tokens):
    out = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out[0].outputs[0].text


def tokens(rng, n):
    return [rng.randrange(10, 1000) for _ in range(n)]


class Busy:
    """A streamed request kept open (so its replica counts one more queued
    request) until closed; closing aborts it."""

    def __init__(self, client, app, prompt, max_tokens):
        self._cm = client.stream("POST", f"/{app}/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True})
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200
        self.replica = self.response.headers[REPLICA_HEADER]

    def close(self):
        self._cm.__exit__(None, None, None)


def full_attention_run(engine, probe) -> int:
    """What a token-prefix router computes for `engine`: the longest run of
    the probe's full-attention blocks held there (its events fed to an index)."""
    index = PrefixIndex(engine.layout)
    index.apply("r", engine.take_kv_events())
    keys, _ = index.block_keys(probe)
    return index.held_tokens(keys).get("r", 0), index.hit_tokens("r", probe)


# -- the event feed (no Ray) ---------------------------------------------------
def test_feed_follows_the_replica_and_recovers_from_a_gap():
    """A router fed every report knows each hit the replica would give; one
    that missed a report (a snapshot too) takes what it missed from the next
    report's backlog and stays exact; one that missed more than the backlog
    notices, forgets the replica, and knows it exactly again from the next
    snapshot."""
    engine = Engine(tiny_model_dir("tiny-gemma3"), enable_kv_events=True, **OPTIONS["tiny-gemma3"])
    reporter = EventReporter(snapshot_every=4, backlog=1, small_snapshot_blocks=0)  # reports 1, 4, 8: snapshots
    every, skips_one, gappy = IndexFeed(), IndexFeed(), IndexFeed()
    missed = {skips_one: {2, 4}, gappy: {5, 6}}
    rng = random.Random(1)
    prompts = [tokens(rng, 40) for _ in range(8)]
    last_taken = {}  # feed -> the truth when it took its latest report
    for seq, prompt in enumerate(prompts, start=1):
        greedy(engine, prompt + tokens(rng, 24), 2)
        report = reporter.report(engine.kv)
        assert report["seq"] == seq and report["snapshot"] == (seq in (1, 4, 8))
        for feed in (every, skips_one, gappy):
            if seq not in missed.get(feed, ()):
                feed.offer("r", report)
        truth = PrefixIndex(engine.layout)  # the replica's state now, read whole
        truth.apply("r", snapshot_events(engine.kv))
        want = [truth.hit_tokens("r", p + [7]) for p in prompts]
        assert [every.hits(p + [7]).get("r", 0) for p in prompts] == want
        for feed in (skips_one, gappy):
            got = [feed.hits(p + [7]).get("r", 0) for p in prompts]
            if seq in missed[feed]:
                assert got == last_taken[feed]  # stale: it has not seen this report yet
            elif feed is gappy and seq == 7:
                assert got == [0] * len(prompts) and not gappy.synced("r") and gappy.num_gaps == 1  # 7 follows 4
            else:
                assert got == want and feed.synced("r"), (seq, feed is gappy)
                last_taken[feed] = want
    assert sum(want) > 0 and every.num_gaps == 0 and skips_one.num_gaps == 0


def test_a_router_that_starts_late_follows_a_small_cache_at_once(monkeypatch):
    """A router's first report of a replica is its latest, not its first:
    while the pool caches few blocks every report is a snapshot, so it
    follows the replica from there (past that, from the next periodic
    snapshot); a router that follows it already takes each report's delta,
    not the snapshot (a reset and every key, milliseconds per replica)."""
    engine = Engine(tiny_model_dir("tiny-gemma3"), enable_kv_events=True, **OPTIONS["tiny-gemma3"])
    small, periodic = EventReporter(snapshot_every=20), EventReporter(snapshot_every=20, small_snapshot_blocks=0)
    rng = random.Random(2)
    prompts = [tokens(rng, 40) for _ in range(3)]
    late, blind, early = IndexFeed(), IndexFeed(), IndexFeed()
    applied = []  # (index, whether the events applied begin with a reset)
    apply = PrefixIndex.apply

    def recording(index, source, events):
        applied.append((index, bool(events) and isinstance(events[0], AllBlocksCleared)))
        return apply(index, source, events)

    monkeypatch.setattr(PrefixIndex, "apply", recording)
    for prompt in prompts:
        greedy(engine, prompt, 2)
        reports = small.report(engine.kv), periodic.report(engine.kv)  # (the second's deltas are empty: unused)
        early.offer("r", reports[0])  # a router there from the start
    assert reports[0]["seq"] == 3 and reports[0]["snapshot"] and not reports[1]["snapshot"]
    late.offer("r", reports[0])
    blind.offer("r", reports[1])
    truth = PrefixIndex(engine.layout)
    truth.apply("r", snapshot_events(engine.kv))
    want = [truth.hit_tokens("r", p + [7]) for p in prompts]
    assert sum(want) > 0 and [late.hits(p + [7]).get("r", 0) for p in prompts] == want and late.synced("r")
    assert not blind.synced("r") and blind.index is None
    assert [early.hits(p + [7]).get("r", 0) for p in prompts] == want and early.synced("r")
    assert [reset for index, reset in applied if index is early.index] == [True, False, False]  # then deltas


def test_recent_routes_count_until_the_reports_catch_up():
    recent = RecentRoutes(horizon_s=10.0)
    recent.add("a", ["k1", "k2", "k3"], now=0.0, reports=4)
    assert recent.hits({"a": 4, "b": 4}, ["k1", "k2", "x"], 16, now=1.0) == {"a": 32}
    assert recent.hits({"a": 5}, ["k1", "k2", "k3", "k4"], 16, now=1.0) == {"a": 48}  # one report: maybe made before
    assert recent.hits({"a": 6}, ["k1"], 16, now=1.0) == {}  # two reports: they say it now
    assert recent.hits({"a": 4}, ["k1"], 16, now=10.5) == {}  # no reports for the horizon: forgotten


# -- routing ---------------------------------------------------------------------
def test_a_request_goes_to_the_replica_holding_its_prefix(cluster, plain):
    rng = random.Random(2)
    prefixes = [tokens(rng, 64) for _ in range(4)]
    held = [complete(cluster, "tiny-gemma3", p + [5], max_tokens=1)[0] for p in prefixes]
    time.sleep(SETTLE_S)
    for prefix, replica in zip(prefixes, held):
        prompt = prefix + tokens(rng, 10)
        answered, text, cached = complete(cluster, "tiny-gemma3", prompt)
        assert (answered, cached) == (replica, 64)
        assert text == greedy(plain("tiny-gemma3"), prompt, 4)


def _busy_scenario(client, app, rng):
    """P on replica A; a long request sharing P keeps A busy while Q (P and
    more) goes to B. Returns (A, B, P, the shared middle)."""
    p, middle = tokens(rng, 64), tokens(rng, 32)
    a = complete(client, app, p + [5], max_tokens=1)[0]
    time.sleep(SETTLE_S)
    busy = Busy(client, app, p + tokens(rng, 8), max_tokens=64)
    try:
        assert busy.replica == a
        b, _, cached = complete(client, app, p + middle + tokens(rng, 17), max_tokens=1)
        assert b != a and cached == 0  # A is one request busier: a 64-token hit does not pay for that
        return a, b, p, middle, busy
    except BaseException:
        busy.close()
        raise


def _probes_go_to(client, app, plain, a, p, middle, rng) -> list[int]:
    """A probe (P, the middle, a new question) goes to A and hits P there, and
    so do three more (so that chance, as with round robin, does not pass)."""
    probe = p + middle + tokens(rng, 16)
    answered, text, cached = complete(client, app, probe)
    assert (answered, cached) == (a, 64)
    assert text == greedy(plain(app), probe, 4)
    for _ in range(3):
        answered, _, cached = complete(client, app, p + middle + tokens(rng, 16), max_tokens=1)
        assert answered == a and cached >= 64
    return probe


def _replay_b(app, seed, *more) -> Engine:
    """What B was sent in the scenario of `seed` (Q, then prompts of `more`:
    (length, tokens generated)), replayed on a plain engine."""
    rng = random.Random(seed)
    p, middle = tokens(rng, 64), tokens(rng, 32)
    tokens(rng, 8)  # the busy request's question, on A
    replay = Engine(tiny_model_dir(app), enable_kv_events=True, **OPTIONS[app])
    greedy(replay, p + middle + tokens(rng, 17), 1)
    for length, max_tokens in more:
        greedy(replay, tokens(rng, length), max_tokens)
    return replay


def test_jamba_prompt_goes_where_its_checkpoint_is(cluster, plain):
    """B holds the probe's full-attention blocks further than A but no Mamba
    checkpoint inside them; A holds the checkpoint at P's end: A wins."""
    a, b, p, middle, busy = _busy_scenario(cluster, "tiny-jamba", random.Random(3))
    busy.close()
    time.sleep(SETTLE_S)
    probe = _probes_go_to(cluster, "tiny-jamba", plain, a, p, middle, random.Random(30))
    # On B a token-prefix router sees 96 tokens (more than A's 64), the hybrid rule no hit.
    assert full_attention_run(_replay_b("tiny-jamba", 3), probe) == (96, 0)


def test_gemma_prompt_avoids_the_replica_whose_window_tail_was_evicted(cluster, plain):
    """B held the probe's full-attention blocks further than A, but a later
    prompt evicted the sliding-window blocks a hit there needs: A wins."""
    rng = random.Random(4)
    a, b, p, middle, busy = _busy_scenario(cluster, "tiny-gemma3", rng)
    try:
        assert complete(cluster, "tiny-gemma3", tokens(rng, 100), max_tokens=40)[0] == b  # A is still busy
    finally:
        busy.close()
    time.sleep(SETTLE_S)
    probe = _probes_go_to(cluster, "tiny-gemma3", plain, a, p, middle, random.Random(40))
    assert full_attention_run(_replay_b("tiny-gemma3", 4, (100, 40)), probe) == (96, 0)


# -- the API, metrics ----------------------------------------------------------------
def test_outputs_equal_one_plain_engine(cluster, plain):
    engine = plain("tiny-gemma3")
    rng = random.Random(5)
    prompt = tokens(rng, 30)
    assert complete(cluster, "tiny-gemma3", prompt, max_tokens=8)[1] == greedy(engine, prompt, 8)
    text = "the quick brown fox"
    assert complete(cluster, "tiny-gemma3", text, max_tokens=8)[1] == \
        greedy(engine, list(engine.tokenizer.encode(text)), 8)
    messages = [{"role": "user", "content": "hello there"}]
    r = cluster.post("/tiny-gemma3/v1/chat/completions",
                     json={"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == greedy(engine, render_chat(engine.tokenizer, messages), 6)
    r = cluster.post("/tiny-gemma3/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy(engine, prompt, 8)
    assert r.text.rstrip().endswith("data: [DONE]") and REPLICA_HEADER in r.headers
    r = cluster.post("/tiny-gemma3/v1/completions", json={"prompt": prompt, "max_tokens": 8, "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]


def test_metrics_per_replica(cluster):
    time.sleep(SETTLE_S)
    text = cluster.get("/tiny-gemma3/metrics").text
    hits = [line for line in text.splitlines() if line.startswith("hybridkv_prefix_cache_hit_tokens_total{")]
    assert len(hits) == 2 and all('replica="' in line for line in hits)
    assert sum(float(line.split()[-1]) for line in hits) > 0


# -- a replica killed mid-load (last: it changes the replica set) ------------------
def test_killed_replica_is_replaced_and_no_request_is_lost(cluster, plain):
    """Kill the replica a stream is on, with requests in flight on both:
    every non-streamed request is answered right (those on the dead replica
    are retried on the other), the stream ends with an error a client can act
    on, and Ray Serve brings the replica count back."""
    engine = plain("tiny-gemma3")
    rng = random.Random(6)
    prompts = [tokens(rng, 24) for _ in range(16)]
    # Longer than the stream below, which starts after them: they are still
    # running when its replica is killed (24 tokens were sometimes done by then).
    expected = [greedy(engine, p, 96) for p in prompts]
    long_prompt = tokens(rng, 24)
    long_expected = greedy(engine, long_prompt, 64)
    retried_before = _retried(cluster)
    results: dict[int, tuple] = {}

    def send(i):
        results[i] = complete(cluster, "tiny-gemma3", prompts[i], max_tokens=96)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    busy = Busy(cluster, "tiny-gemma3", long_prompt, max_tokens=64)
    lines = busy.response.iter_lines()
    first = next(line for line in lines if line.startswith("data: {"))  # it is generating
    victim = next(n for n in ray.util.list_named_actors(all_namespaces=True)
                  if n["name"].endswith(f"tiny-gemma3#EngineReplica#{busy.replica}"))
    before = _engine_replicas("tiny-gemma3")
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    events = [first] + [line for line in lines if line.startswith("data: ")]
    busy.close()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "replica_failed" and "retry" in error["message"]
    streamed = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-2])
    assert long_expected.startswith(streamed)  # what did arrive is right
    for t in threads:
        t.join(120)
    assert [results[i][1] for i in range(len(prompts))] == expected  # every one answered, and right
    assert _retried(cluster) > retried_before  # some were on the dead replica
    new = _wait_replaced("tiny-gemma3", before)  # Ray Serve started a replacement
    fresh = [tokens(rng, 24) for _ in range(6)]
    answers = [complete(cluster, "tiny-gemma3", p, max_tokens=8) for p in fresh]
    assert [text for _, text, _ in answers] == [greedy(engine, p, 8) for p in fresh]
    assert new in {replica for replica, _, _ in answers} and busy.replica not in {r for r, _, _ in answers}


def _engine_replicas(app: str) -> set[str]:
    return {n["name"].rsplit("#", 1)[-1] for n in ray.util.list_named_actors(all_namespaces=True)
            if f"{app}#EngineReplica#" in n["name"]}


def _wait_replaced(app: str, before: set[str], timeout: float = 120) -> str:
    """The id of the replica Ray Serve started in place of a dead one (of
    the replicas `before`), once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids = _engine_replicas(app)
        if len(ids) == 2 and len(ids - before) == 1:
            _wait_running(app)
            time.sleep(SETTLE_S)  # the routers hear of it
            return (ids - before).pop()
        time.sleep(0.2)
    raise TimeoutError(f"no replacement among the replicas of {app}: {ids}, before {before}")


def _wait_metric(client, app: str, pattern: str, timeout: float = 60) -> None:
    """Until the ingress's /metrics (the replicas' reports as its router
    last took them) has a line matching `pattern`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = client.get(f"/{app}/metrics").text
        if re.search(pattern, text):
            return
        time.sleep(0.1)
    raise TimeoutError(f"no line of /{app}/metrics matches {pattern!r}:\n{text}")


def _retried(client) -> float:
    text = client.get("/tiny-gemma3/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("hybridkv_requests_retried_total"))
    return float(line.split()[-1])


def served_like_plain(cluster, plain, app, options, docs) -> int:
    """Deploy `app`: two replicas of tiny Gemma-3 with engine `options`; send
    each document, then each with a question, and check every text against
    the plain engine's. Returns the cached tokens, summed."""
    serve.run(build_application(tiny_model_dir("tiny-gemma3"), model_name="tiny-gemma3", num_replicas=2,
                                engine_options=options, stats_period_s=STATS_PERIOD_S, snapshot_every=5),
              name=app, route_prefix=f"/{app}", blocking=False)
    _wait_running(app)
    try:
        engine = plain("tiny-gemma3")
        cached = 0
        for prompt in docs + [d + [7, 8] for d in docs]:
            _, text, hit = complete(cluster, app, prompt, max_tokens=6)
            assert text == greedy(engine, prompt, 6)
            cached += hit
        return cached
    finally:
        serve.delete(app)


def test_replicas_with_host_and_disk_tiers_equal_one_plain_engine(cluster, plain, tmp_path):
    # Both replicas keep evicted blocks in host memory and share one disk
    # directory; the pool holds about two of these prompts, so revisits hit
    # the tiers. Outputs equal the plain engine's.
    options = dict(OPTIONS["tiny-gemma3"], kv_host_cache_memory="1MiB", kv_disk_cache=str(tmp_path))
    rng = random.Random(9)
    assert served_like_plain(cluster, plain, "tiers", options, [tokens(rng, 90) for _ in range(4)]) > 0


def test_replicas_with_tensor_parallelism_equal_one_plain_engine(cluster, plain):
    # Each replica is an engine of two ranks (its worker process started by
    # the engine inside Ray's actor); Ray counts two CPUs per replica.
    options = dict(OPTIONS["tiny-gemma3"], tensor_parallel_size=2)
    rng = random.Random(5)
    served_like_plain(cluster, plain, "tp", options, [tokens(rng, 50) for _ in range(3)])


def test_prefill_and_decode_replicas_equal_one_plain_engine(cluster, plain, tmp_path):
    # One prefill replica and one decode replica meeting in one directory:
    # each prompt is computed on the prefill replica, and the decode replica
    # takes its whole hit from what that left there. Outputs equal the plain
    # engine's; a prompt seen before is served by the decode replica's pool.
    app = "disaggregated"
    options = dict(OPTIONS["tiny-gemma3"], kv_disk_cache=str(tmp_path))
    serve.run(build_application(tiny_model_dir("tiny-gemma3"), model_name="tiny-gemma3", num_replicas=1,
                                prefill_replicas=1, engine_options=options, stats_period_s=STATS_PERIOD_S),
              name=app, route_prefix=f"/{app}", blocking=False)
    _wait_running(app, replicas=1)
    _wait_running(app, replicas=1, deployment="PrefillReplica")
    try:
        engine = plain("tiny-gemma3")
        rng = random.Random(11)
        for prompt in [tokens(rng, 90) for _ in range(3)]:
            _, text, hit = complete(cluster, app, prompt, max_tokens=6)
            assert text == greedy(engine, prompt, 6)
            assert hit == (len(prompt) - 1) // 16 * 16  # the whole hit, from the prefill replica's blocks
        metrics = cluster.get(f"/{app}/metrics").text
        assert 'hybridkv_prefills_total{outcome="done"} 3.0' in metrics
        # The router has the decode replica's report made after those prompts (and so its blocks).
        _wait_metric(cluster, app, r'hybridkv_generation_tokens_total\{replica="[^"]+"\} 18\.0')
        # A prompt the decode replica holds, and a short one, are computed there: no transfer.
        for prompt, expected_hit in ((prompt + [7, 8, 9], (len(prompt) + 2) // 16 * 16), (tokens(rng, 40), 0)):
            _, text, hit = complete(cluster, app, prompt, max_tokens=6)
            assert text == greedy(engine, prompt, 6) and hit == expected_hit
        metrics = cluster.get(f"/{app}/metrics").text
        router = [line for line in metrics.splitlines() if line.startswith(("hybridkv_prefills_total",
                                                                            "hybridkv_router_"))]
        assert 'hybridkv_prefills_total{outcome="done"} 3.0' in metrics, router
        assert 'hybridkv_prefills_total{outcome="local"} 2.0' in metrics, router
        assert any(line.startswith("hybridkv_router_replica_synced{") for line in router), router
    finally:
        serve.delete(app)


def test_prefill_replicas_need_the_shared_directory():
    with pytest.raises(ValueError, match="prefill replicas need kv_disk_cache"):
        build_application(tiny_model_dir("tiny-gemma3"), model_name="tiny-gemma3", num_replicas=1,
                          prefill_replicas=1, engine_options=dict(OPTIONS["tiny-gemma3"]))
