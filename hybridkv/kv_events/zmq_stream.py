"""An engine's KV events over ZMQ, in vLLM's publisher protocol (the wire
format itself is kv_wire.py), and a subscriber that reads them back.

The protocol, as vLLM's ZMQ publisher speaks it:

* a PUB socket sends each batch as a three-frame message `[topic, seq,
  payload]`: the topic bytes (empty by default), the batch's sequence
  number as 8 bytes big-endian (0, 1, 2, ... per publisher), the msgpack
  batch;
* a ROUTER socket (the replay endpoint) answers a request `[start]` (8
  bytes big-endian) from a DEALER with every buffered batch numbered
  `start` or later, each as `[topic, seq, payload]`, then an end marker
  `[b"", -1 as 8 bytes, b""]`.

Both sockets are bound by the publisher; subscribers connect.

Off the engine's hot path: the engine thread hands each step's events to a
bounded queue (`send`, never blocking) and one background thread encodes,
numbers, sends and answers replays. A slow or absent subscriber costs
nothing: PUB drops what a subscriber's buffer (the high-water mark) cannot
take, and the replay buffer lets it catch up. When the queue is full (the
publisher thread fell behind), the batch is dropped, and the next one sent
is a snapshot instead: a reset followed by every key each group holds, so a
subscriber's view is exact again after it. A snapshot also goes out every
`snapshot_every` batches, so a subscriber that joins after the replay
buffer has rolled over, or lost more than it holds, gets back in step.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from itertools import count
from typing import NamedTuple

import zmq

from ..core.events import AllBlocksCleared
from ..core.layout import KVCacheLayout
from .feed import snapshot_events
from .wire import WireFormat

log = logging.getLogger("hybridkv.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def _bind(socket: zmq.Socket, endpoint: str, what: str) -> str:
    """Bind and return the endpoint bound (a port of 0 or * takes a free one)."""
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot bind the KV event {what} socket to {endpoint!r}: {e}") from e
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def next_port_endpoint(endpoint: str) -> str | None:
    """The replay endpoint beside a tcp endpoint: the next port (None for a
    port chosen by the system, which has no next one)."""
    if not endpoint.startswith("tcp://"):
        return None
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return None
    return f"{head}:{int(port) + 1}"


class KVEventPublisher:
    """Publishes one engine's KV events (see the module's docstring)."""

    def __init__(self, endpoint: str, wire: WireFormat, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = 10_000, max_queue: int = 1_000, hwm: int = 100_000,
                 snapshot_every: int = 1_000):
        self.wire = wire
        self.topic = topic.encode()
        self.snapshot_every = snapshot_every
        self.num_dropped = 0  # batches dropped because the queue was full
        self.num_sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._buffer: deque = deque(maxlen=buffer_batches)  # (seq, payload) for replays
        self._resync = False  # the next batch must be a snapshot
        self._batches = 0  # handed over by send(), for snapshot_every
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self.endpoint = _bind(self._pub, endpoint, "publisher")
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint, "replay")
        except Exception:
            self._close_sockets()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events", daemon=True)
        self._thread.start()

    # -- the engine thread's side ------------------------------------------
    def send(self, kv) -> None:
        """Hand over what manager `kv` (enable_kv_events=True) did since
        the last call; returns at once. Call where nothing else touches
        `kv` (the engine thread)."""
        events = kv.take_events()  # drained every time, so a snapshot leaves nothing behind it
        due = self.snapshot_every and self._batches % self.snapshot_every == self.snapshot_every - 1
        if self._resync or (due and events):
            events = snapshot_events(kv)
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped += 1
            self._resync = True
            return
        self._resync = False
        self._batches += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch handed over is sent; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    # -- the publisher thread ----------------------------------------------
    def _run(self) -> None:
        seq = count()
        while True:
            try:
                events = self._queue.get(timeout=0.01)
            except queue.Empty:
                events = None
            try:
                if events is not None:
                    try:
                        payload = self.wire.encode(events)
                        number = next(seq)
                        self._pub.send_multipart((self.topic, number.to_bytes(8, "big"), payload))
                        self._buffer.append((number, payload))
                        self.num_sent += 1
                    finally:
                        self._queue.task_done()
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
            except Exception:  # one bad batch or request must not end publishing
                log.exception("publishing KV events failed")
            if events is None and self._stop.is_set() and self._queue.empty():
                return

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for number, payload in list(self._buffer):
            if number >= first:
                self._replay.send_multipart((client, b"", self.topic, number.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


class KVEventSubscriber:
    """Reads one publisher's batches in order, filling gaps from its replay
    socket. `receive()` returns lists of core events to apply in order, e.g.
    to a PrefixIndex; when a gap cannot be filled it returns a reset
    (AllBlocksCleared: forget what was known of this publisher) and then
    nothing until the publisher's next snapshot, so what it hands over never
    claims a block the engine does not hold."""

    def __init__(self, endpoint: str, wire: WireFormat, *, replay_endpoint: str | None = None, topic: str = ""):
        self.wire = wire
        self.topic = topic.encode()
        self.replay_endpoint = replay_endpoint
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(endpoint)
        self.last_seq = -1  # the last batch seen
        self.synced = True  # what was handed over describes the publisher exactly (at first: nothing, as at seq 0)
        self.num_gaps = 0

    def receive(self, timeout: float = 0.0) -> list[list]:
        """The batches that arrived (waiting up to `timeout` seconds for
        the first), as lists of events, in order."""
        out: list[list] = []
        wait = int(timeout * 1000)
        while self._sub.poll(wait):
            wait = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1 and self.replay_endpoint is not None:
                for number, missed in self._replayed(self.last_seq + 1, before=seq):
                    self._advance(number, missed, out)
            self._advance(seq, payload, out)
        return out

    def _advance(self, seq: int, payload: bytes, out: list) -> None:
        if seq <= self.last_seq:
            return
        if seq != self.last_seq + 1:  # batches are missing for good
            self.num_gaps += 1
            if self.synced:
                out.append([AllBlocksCleared()])
            self.synced = False
        self.last_seq = seq
        _, events = self.wire.decode(payload)
        if not self.synced and events and type(events[0]) is AllBlocksCleared:
            self.synced = True  # a snapshot: exact again from here
        if self.synced:
            out.append(events)

    def _replayed(self, first: int, before: int, timeout_ms: int = 2_000):
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while dealer.poll(timeout_ms):
                _, _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    return
                number = int.from_bytes(seq_bytes, "big")
                if number < before:
                    yield number, payload
            log.warning("the KV event replay at %s did not answer", self.replay_endpoint)
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._context.term()


class ServerEvents(NamedTuple):
    """What `GET /kv_events` says, with the layout rebuilt."""
    endpoint: str
    replay_endpoint: str | None
    topic: str
    hash_function: str
    layout: KVCacheLayout


def subscribe_to_server(url: str, timeout: float = 10.0) -> tuple[KVEventSubscriber, ServerEvents]:
    """A subscriber to the KV events of `hybridkv serve` at `url` (its base
    URL), from what its `GET /kv_events` says. An endpoint bound on every
    interface (`tcp://*:PORT`) is reached at the server's own host."""
    with urllib.request.urlopen(url.rstrip("/") + "/kv_events", timeout=timeout) as response:
        info = json.loads(response.read())
    host = urllib.parse.urlsplit(url).hostname

    def reachable(endpoint: str | None) -> str | None:
        if endpoint is None:
            return None
        for anywhere in ("//0.0.0.0:", "//[::]:", "//*:"):
            endpoint = endpoint.replace(anywhere, f"//{host}:")
        return endpoint

    server = ServerEvents(reachable(info["endpoint"]), reachable(info["replay_endpoint"]), info["topic"],
                          info["hash_function"], KVCacheLayout.from_dict(info["layout"]))
    subscriber = KVEventSubscriber(server.endpoint, WireFormat(server.layout), topic=server.topic,
                                   replay_endpoint=server.replay_endpoint)
    return subscriber, server
