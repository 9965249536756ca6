"""What one request may carry, and what a heavy one costs the others (issue
65's probe, docs/server.md):

* bodies past the bounds on messages, content parts and stop strings are
  400s naming the bound;
* bodies of many messages, past the bound and just within it, beside small
  requests: the small ones' latency stays within 2x of an idle server's
  (before the bounds, 130,000 one-character messages made them 27x slower);
* long stop lists within the bounds, the same (before, the stop strings
  were checked one by one at every token, on the engine's thread).

One `hybridkv serve` on the built-in tiny-gemma3, in a process of its own:
the clients here must not share its GIL.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")
httpx = pytest.importorskip("httpx", reason="needs the test extra: pip install -e '.[test]'")

from hybridkv.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402
from hybridkv.server.protocol import MAX_CONTAINERS, MAX_CONTENT_PARTS, MAX_MESSAGES, containers  # noqa: E402
from serving import served, small_latencies  # noqa: E402

JSON = {"Content-Type": "application/json"}
IDLE_SECONDS = 1.0  # of small requests, before and after; twice as long beside the heavy ones


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # Bodies up to 8 MiB (tiny-gemma3's default bound is 1.5 MiB): the probe's body of 4.4 MB is read
    args = ["--kv-cache-memory", "64MiB", "--max-body-bytes", "8MiB", "--log-level", "warning"]
    with served(args, tmp_path_factory.mktemp("bounds") / "server.log", env={"OMP_NUM_THREADS": "1"}) as (base, _):
        yield base


def messages(n: int, content="x") -> list[dict]:
    return [{"role": "user", "content": content}] * n


def parts(n: int) -> list[dict]:
    return [{"type": "text", "text": "x"}] * n


PAST = [
    ("/v1/chat/completions", {"messages": messages(MAX_MESSAGES + 1)},
     f"at most {MAX_MESSAGES} messages; got {MAX_MESSAGES + 1}", "messages"),
    ("/v1/chat/completions", {"messages": messages(1, parts(MAX_CONTENT_PARTS + 1))},
     f"at most {MAX_CONTENT_PARTS} content parts in all messages together; got {MAX_CONTENT_PARTS + 1}", "messages"),
    # more objects or arrays than any request within the bounds: counted before anything builds them
    ("/v1/chat/completions", {"messages": messages(130_000)}, f"more than {MAX_CONTAINERS} JSON objects", None),
    ("/v1/completions", {"prompt": [[1]] * 400_000}, f"more than {MAX_CONTAINERS} JSON objects", None),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)},
     f"at most {MAX_STOP_STRINGS} stop strings; got {MAX_STOP_STRINGS + 1}", "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS // 2 + 1)] * 2},
     f"at most {MAX_STOP_CHARS} characters in all stop strings together; got {MAX_STOP_CHARS + 2}", "stop"),
    ("/v1/completions", {"prompt": ["a", "b"] * 100_000}, "one prompt per request", "prompt"),
]


@pytest.mark.parametrize("path,body,message,param", PAST, ids=[m for _, _, m, _ in PAST])
def test_a_body_past_a_bound_is_a_400_naming_it(url, path, body, message, param):
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


text = st.text(st.sampled_from('ab[]{}"\\:, \n\u00fc\U0001f600'), max_size=8)  # JSON's own characters inside strings
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                           max_leaves=30)


def objects_and_arrays(value) -> int:
    inner = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if inner is None else 1 + sum(map(objects_and_arrays, inner))


@settings(max_examples=500, deadline=None)
@given(value=json_values, ascii=st.booleans(), indent=st.sampled_from([None, 1]))
def test_the_body_scan_counts_objects_and_arrays_outside_strings(value, ascii, indent):
    body = json.dumps(value, ensure_ascii=ascii, indent=indent).encode()
    assert containers(body, 10**6) == objects_and_arrays(value)
    assert containers(body, 2) == min(objects_and_arrays(value), 3)  # it stops past the bound


def test_requests_at_the_bounds_are_served(url):
    stop = [f"{i:03d}" * 85 + "!" for i in range(MAX_STOP_STRINGS)]  # 256 characters each: 64 KiB in all
    assert sum(map(len, stop)) == MAX_STOP_CHARS
    plain = {"prompt": "hi", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**plain, "stop": stop}, timeout=60)
    assert r.status_code == 200, r.text
    alone = httpx.post(url + "/v1/completions", json=plain, timeout=60)
    assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    # As many messages and content parts as allowed: refused only for the tiny model's context
    chat = {"messages": messages(MAX_MESSAGES, parts(MAX_CONTENT_PARTS // MAX_MESSAGES)), "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "does not fit the model context of 8192 tokens" in r.text, r.text


def means_beside(url: str, send, clients: int) -> tuple[float, float, float]:
    """Small requests' mean seconds: idle, while `clients` threads each
    call `send(httpx_client)` until told to stop, and idle again (other
    work on the machine comes and goes). Means over a few seconds, not
    medians of a few requests: a body that stops the server for a second
    every second and a half leaves most small requests as fast as idle,
    and one in each pause a second slower."""
    with httpx.Client(base_url=url, timeout=120) as client:
        small_latencies(client, 3)  # warm up
        idle = small_latencies(client, 0, seconds=IDLE_SECONDS)
        stop, errors = threading.Event(), []

        def heavy():
            try:
                with httpx.Client(base_url=url, timeout=120) as other:
                    while not stop.is_set():
                        send(other)
            except BaseException as e:  # reported by the test
                errors.append(e)

        threads = [threading.Thread(target=heavy) for _ in range(clients)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        try:
            busy = small_latencies(client, 0, seconds=2 * IDLE_SECONDS)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        idle_after = small_latencies(client, 0, seconds=IDLE_SECONDS)
    assert not errors, errors
    return statistics.mean(idle), statistics.mean(busy), statistics.mean(idle_after)


def within_2x_of_idle(what: str, idle: float, busy: float, idle_after: float) -> None:
    print(f"\nsmall requests, mean: idle {1000 * idle:.1f} ms, beside {what} {1000 * busy:.1f} ms, "
          f"idle again {1000 * idle_after:.1f} ms")
    assert busy <= 2 * max(idle, idle_after), (busy, idle, idle_after)


def test_many_messages_beside_small_requests_keep_their_latency_within_2x_of_idle(url):
    # The probe's body: 130,000 one-character messages (4.4 MB), refused for
    # the bound; and one of 2048 messages, within it, rendered and
    # tokenized, then refused for the context (14,344 tokens), so the engine
    # stays out of it. A pause after each pair: the one within the bound is
    # ~15 ms of Python work (pydantic, the chat template) holding the GIL;
    # back to back they would be a CPU load of their own on 2 cores.
    past = json.dumps({"messages": messages(130_000)}).encode()
    within = json.dumps({"messages": messages(MAX_MESSAGES), "max_tokens": 2}).encode()

    def send(client):
        r = client.post("/v1/chat/completions", content=past, headers=JSON)
        assert r.status_code == 400 and "JSON objects and arrays" in r.text, r.text
        r = client.post("/v1/chat/completions", content=within, headers=JSON)
        assert r.status_code == 400 and "does not fit the model context" in r.text, r.text
        time.sleep(0.2)

    within_2x_of_idle("bodies of many messages", *means_beside(url, send, clients=1))


def test_long_stop_lists_beside_small_requests_keep_their_latency_within_2x_of_idle(url):
    # Two clients generating 256 tokens each with 256 stop strings of 256
    # characters (the bounds), which the model's text never completes.
    stop = [f"{i:03d}" * 85 + "!" for i in range(MAX_STOP_STRINGS)]
    body = json.dumps({"prompt": "hi", "max_tokens": 256, "ignore_eos": True, "stop": stop}).encode()

    def send(client):
        r = client.post("/v1/completions", content=body, headers=JSON)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text

    within_2x_of_idle("long stop lists", *means_beside(url, send, clients=2))
