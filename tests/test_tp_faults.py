"""A tensor-parallel worker that hangs or dies under a server
(engine/tensor_parallel.py's watchdog, engine/engine_loop.py's `_lost`):
stopped (SIGSTOP) while requests run or while idle, or killed while idle,
it turns /health to 503 within seconds, naming the worker, without needing
a request; the requests in flight and those that come after fail with that
message instead of waiting out the collectives' 600 s; the server keeps
answering and stops cleanly. Each case is one two-rank engine on the tiny
Gemma-3 (a few seconds to start on 2 cores), its heartbeat bound at 2 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")
httpx = pytest.importorskip("httpx", reason="needs the test extra: pip install -e '.[test]'")

from hybridkv import Engine, SamplingParams  # noqa: E402
from hybridkv.engine.engine_loop import EngineFailed, EngineLoop  # noqa: E402
from hybridkv.server import build_app  # noqa: E402
from hybridkv.tiny_models import tiny_model_dir  # noqa: E402
from serving import running  # noqa: E402

HEARTBEAT = 2.0  # seconds a worker may be silent (the default is 5)
SOON = HEARTBEAT + 3  # what "within seconds" allows on a busy 2-core machine
LONG = {"prompt": [5, 6, 7], "max_tokens": 8000, "ignore_eos": True}  # runs far past the fault


@contextlib.contextmanager
def two_rank_server():
    """(URL, rank 1's process) of a server over a two-rank engine; after,
    the server has stopped (`running` checks it) and so has the worker."""
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="64MiB", progress=False, tensor_parallel_size=2,
                    tensor_parallel_heartbeat_timeout=HEARTBEAT)
    worker = engine.executor.workers[0]
    with running(build_app(engine, model_name="m")) as url:
        try:
            assert httpx.get(url + "/health").status_code == 200
            yield url, worker
        finally:
            if worker.is_alive():  # the watchdog has not killed it: a failing test must still end
                worker.kill()
    worker.join(10)
    assert worker.exitcode == -signal.SIGKILL


def until_unhealthy(url: str, since: float) -> tuple[float, dict]:
    """Seconds from `since` until /health stops answering 200, and its body."""
    while True:
        answer = httpx.get(url + "/health", timeout=5)
        if answer.status_code != 200:
            assert answer.status_code == 503
            return time.monotonic() - since, answer.json()
        assert time.monotonic() - since < 15, "/health still answers 200"
        time.sleep(0.05)


def test_a_worker_stopped_mid_request_fails_the_requests_and_health_within_seconds():
    with two_rank_server() as (url, worker):
        plain = {}

        def post():
            answer = httpx.post(url + "/v1/completions", json=LONG, timeout=30)
            plain.update(status=answer.status_code, body=answer.json(), at=time.monotonic())

        thread = threading.Thread(target=post)
        thread.start()
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(events)[6:])  # tokens flow
            stopped = time.monotonic()
            os.kill(worker.pid, signal.SIGSTOP)
            seconds, health = until_unhealthy(url, stopped)
            *_, error, done = events  # the stream ends: its last tokens, an error, [DONE]
            streamed = time.monotonic() - stopped
        thread.join(30)
        assert not thread.is_alive()
        message = "tensor-parallel worker hybridkv-tp-1 stopped answering: no heartbeat for"
        assert seconds < SOON and message in health["error"]["message"]
        assert done == "data: [DONE]" and message in json.loads(error[6:])["error"]["message"]
        assert plain["status"] == 500 and message in plain["body"]["error"]["message"]
        assert streamed < SOON and plain["at"] - stopped < SOON
        print(f"SIGSTOP mid-request: /health 503 after {seconds:.2f} s, the stream ended after {streamed:.2f} s, "
              f"the plain request's 500 after {plain['at'] - stopped:.2f} s")


@pytest.mark.parametrize("sent, problem", [
    (signal.SIGSTOP, "stopped answering: no heartbeat for"),
    (signal.SIGKILL, "exited (code -9)"),
], ids=["SIGSTOP", "SIGKILL"])
def test_a_worker_stopped_or_killed_while_idle_turns_health_503_without_a_request(sent, problem):
    with two_rank_server() as (url, worker):
        sent_at = time.monotonic()
        os.kill(worker.pid, sent)
        seconds, health = until_unhealthy(url, sent_at)
        message = f"tensor-parallel worker hybridkv-tp-1 {problem}"
        assert message in health["error"]["message"] and seconds < SOON
        late = httpx.post(url + "/v1/completions", json=LONG, timeout=30)  # refused at once, not hung
        assert late.status_code == 500 and message in late.json()["error"]["message"]
        assert httpx.get(url + "/health").status_code == 503  # the server still answers
        print(f"{signal.Signals(sent).name} while idle: /health 503 after {seconds:.2f} s")


def test_requests_fail_even_while_the_engine_thread_stays_blocked(monkeypatch):
    # The watchdog's side alone: the engine thread is stuck in a step (as in
    # a collective no kill could end), and the requests must fail anyway.
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="16MiB", progress=False)
    listeners, stuck, release = [], threading.Event(), threading.Event()
    monkeypatch.setattr(engine.executor, "watch", listeners.append)

    def blocked_step():
        stuck.set()
        release.wait(30)
        raise RuntimeError("the collective failed")

    monkeypatch.setattr(engine, "step", blocked_step)

    async def run():
        engine_loop = EngineLoop(engine)
        engine_loop.start()
        try:
            stream = await engine_loop.submit([5, 6, 7], SamplingParams(max_tokens=4), "waiting")
            await asyncio.to_thread(stuck.wait, 10)
            await asyncio.to_thread(listeners[0], "tensor-parallel worker hybridkv-tp-1 stopped answering")
            with pytest.raises(EngineFailed, match="the engine failed: tensor-parallel worker hybridkv-tp-1 stopped"):
                await asyncio.wait_for(stream.__anext__(), 5)
            assert not engine_loop.alive
            release.set()  # the step fails now too; the error keeps its first cause
            with pytest.raises(EngineFailed, match="hybridkv-tp-1 stopped"):
                await asyncio.wait_for(engine_loop.submit([5, 6], SamplingParams(max_tokens=4), "late"), 5)
            assert not await engine_loop.call(lambda e: e.has_unfinished_requests())
        finally:
            release.set()
            engine_loop.shutdown()

    asyncio.run(run())
