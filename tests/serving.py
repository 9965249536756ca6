"""Run a FastAPI app on a free loopback port in a thread, or `hybridkv
serve` in a process of its own, for tests; and time small requests to it
(the fault tests compare them beside heavy ones with an idle server's)."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request


@contextlib.contextmanager
def running(app):
    """Yield the base URL while `app` serves; shut it down after."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held from here on: no race with other processes
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


def small_latencies(client, n: int, seconds: float = 0.0) -> list[float]:
    """Seconds for each of `n` small completions and a /metrics scrape, or
    of as many as there is time for in `seconds` if more (`client`: an
    httpx.Client on the server's base URL)."""
    times = []
    until = time.perf_counter() + seconds
    for i in itertools.count():
        started = time.perf_counter()
        if i >= n and started >= until:
            break
        r = client.post("/v1/completions", json={"prompt": f"a small request {i}", "max_tokens": 4,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert client.get("/metrics").status_code == 200
        times.append(time.perf_counter() - started)
    return times


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(args: list[str], log_path, env: dict | None = None, ready: str = "/health", timeout: float = 180):
    """`hybridkv serve ARGS --port P` in a new process (and session: it and
    all it starts can be told apart); yields (base URL, the process) once
    `ready` answers, and stops it with SIGTERM after."""
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "hybridkv.cli", "serve", *args, "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, open(log_path).read()[-3000:]
            try:
                with urllib.request.urlopen(base + ready, timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start: " + open(log_path).read()[-3000:]
                time.sleep(0.5)
        yield base, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()
