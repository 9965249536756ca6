"""Run a FastAPI app on a free loopback port in a thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


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
