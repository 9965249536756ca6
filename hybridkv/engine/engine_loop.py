"""The one thread that owns the engine, and how asyncio code talks to it.

`Engine` is not thread-safe, and its step is blocking torch work: it must not
run on the event loop. So one background thread owns the engine and is the
only caller of every engine method. The event loop talks to it through a
thread-safe inbox of commands (add a request, abort one, run a function on
the engine); the thread drains the inbox before every step, so an abort takes
effect before the next step. Results go back with
`loop.call_soon_threadsafe` into one asyncio queue per request, one hand-off
per step for all requests.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Engine
from .sampling_params import SamplingParams
from .text_stream import TextStream

log = logging.getLogger("hybridkv.engine")


class Overloaded(Exception):
    """The waiting queue is at its bound (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The engine raised where it never should, or the server is stopping (HTTP 500)."""


@dataclass
class Delta:
    index: int  # which of the n continuations
    text: str
    finish_reason: str | None = None


@dataclass
class Update:
    """What one step did for one request."""
    deltas: list[Delta]
    finished: bool
    prompt_tokens: int
    completion_tokens: int  # all continuations, so far
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


_ACCEPTED = object()


class RequestStream:
    """The asyncio side of one request: iterate for its updates."""

    def __init__(self, owner: "EngineLoop", request_id: str):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        self.headers: dict[str, str] = {}  # response headers an engine client adds (none here)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def abort(self) -> None:
        """Stop the request and free its blocks; a no-op once it finished."""
        if not self._done:
            self._done = True
            owner, request_id = self._owner, self.request_id
            owner._put(lambda: owner._abort(request_id))

    def __del__(self):
        # A stream dropped unfinished (say, a client gone before its streaming
        # response began) must not keep generating: the engine thread holds
        # only its queue, so dropping the stream lands here.
        try:
            self.abort()
        except Exception:  # the loop is already shut down
            pass


@dataclass
class _Live:
    queue: asyncio.Queue  # the stream's, not the stream: see RequestStream.__del__
    texts: list[TextStream]
    prompt_tokens: int
    ttft_seen: bool = False


class EngineLoop:
    def __init__(self, engine: Engine, max_waiting: int = 512, ttft_histogram=None, kv_publisher=None):
        self.engine = engine
        # kv_events/zmq_stream.py's KVEventPublisher, or None: handed the
        # manager's events after every step and command, here, the one
        # thread that touches the manager.
        self.kv_publisher = kv_publisher
        self.max_waiting = max_waiting  # read by the engine thread at each add
        self.ttft_histogram = ttft_histogram  # a prometheus Histogram (thread-safe), or None
        self.num_aborted = 0
        self.num_rejected = 0
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the event loop's side ---------------------------------------------
    def start(self) -> None:
        """Call from the event loop that will consume the results."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()
        self.engine.executor.watch(self._lost)

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._put(None)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def submit(self, prompt: str | list[int] | Callable, params: SamplingParams, request_id: str, *,
                     cache_salt: str | None = None) -> RequestStream:
        """Queue a request; raises ValueError (bad input), Overloaded or
        EngineFailed. `prompt`: token ids (the app tokenizes in worker
        threads), or text or `fn(tokenizer) -> token ids` (a chat template),
        which are tokenized on the engine thread: the other requests wait
        meanwhile."""
        stream = RequestStream(self, request_id)
        # The command holds the stream's queue, not the stream: were the
        # engine thread still holding the command when the caller drops the
        # stream, the stream's abort (__del__) would run there, late, and
        # land behind commands queued after it.
        out = stream._queue
        self._put(lambda: self._add(request_id, out, prompt, params, cache_salt))
        try:
            first = await stream._queue.get()
        except asyncio.CancelledError:  # the client left before the engine answered
            stream.abort()
            raise
        if isinstance(first, BaseException):
            raise first
        return stream

    def call(self, fn) -> asyncio.Future:
        """Run `fn(engine)` on the engine thread; await the returned future for
        its result. Queued at once, in order with aborts and adds."""
        future = self._loop.create_future()

        def run():
            try:
                result = fn(self.engine)
            except Exception as e:  # handed to the caller
                self._deliver(_settle, future, None, e)
            else:
                self._deliver(_settle, future, result, None)

        self._put(run)
        return future

    def _put(self, command) -> None:
        if self._thread is None:
            raise EngineFailed("the engine loop is not running")
        self._inbox.put(command)

    def _deliver(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    # -- the engine thread -------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests() and self.error is None
            try:
                command = self._inbox.get(block=not busy)
            except queue.Empty:
                command = _NOTHING
            while command is not _NOTHING:
                if command is None:
                    self._close()
                    return
                try:
                    command()
                except Exception:  # a bug in a command must not kill the only engine thread
                    log.exception("engine loop command failed")
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = _NOTHING
            if self.error is None and engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:
                    self._fail(e)
                else:
                    self._publish(outputs)
            if self.kv_publisher is not None:
                try:
                    self.kv_publisher.send(engine.kv)
                except Exception:  # events are a side channel: serving goes on
                    log.exception("handing over KV events failed")

    def _add(self, request_id, out, prompt, params, cache_salt) -> None:
        engine = self.engine
        if self.error is not None:
            return self._deliver(out.put_nowait, EngineFailed(f"the engine failed: {self.error}"))
        if len(engine.scheduler.waiting) >= self.max_waiting:
            self.num_rejected += 1
            return self._deliver(out.put_nowait, Overloaded(
                f"the server is overloaded: {len(engine.scheduler.waiting)} requests are waiting "
                f"(bound {self.max_waiting}); retry later"))
        try:
            ids = self._token_ids(prompt)
            engine.add_request(ids, params, request_id=request_id, cache_salt=cache_salt)
        except ValueError as e:
            return self._deliver(out.put_nowait, e)
        except Exception as e:  # not the client's fault: a 500, and the loop goes on
            log.exception("adding request %s failed", request_id)
            return self._deliver(out.put_nowait, EngineFailed(f"could not add the request: {e}"))
        texts = [TextStream(engine.tokenizer, params.skip_special_tokens, params.stop_strings) for _ in range(params.n)]
        self._live[request_id] = _Live(out, texts, len(ids))
        self._deliver(out.put_nowait, _ACCEPTED)

    def _token_ids(self, prompt):
        """Token ids pass through; text is tokenized here (see submit)."""
        return prompt_token_ids(self.engine.tokenizer, prompt)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.num_aborted += 1

    def _publish(self, outputs) -> None:
        batch = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if not live.ttft_seen and out.metrics is not None and out.metrics.ttft is not None:
                live.ttft_seen = True
                if self.ttft_histogram is not None:
                    self.ttft_histogram.observe(out.metrics.ttft)
            deltas = []
            for completion in out.outputs:
                text = live.texts[completion.index]
                if text.finished:
                    continue
                if completion.finish_reason is not None:
                    deltas.append(Delta(completion.index, text.finish(completion.text), completion.finish_reason))
                else:
                    piece = text.push(completion.token_ids)
                    if piece:
                        deltas.append(Delta(completion.index, piece))
            if deltas or out.finished:
                generated = sum(len(c.token_ids) for c in out.outputs)
                cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
                batch.append((live.queue, Update(deltas, out.finished, live.prompt_tokens, generated, cached)))
            if out.finished:
                del self._live[out.request_id]
        if batch:
            self._deliver(_hand_out, batch)

    def _fail(self, error: Exception) -> None:
        """A step raised: a bug, not bad input. Fail every request in flight,
        keep answering commands (adds are refused), never step again."""
        log.exception("engine step failed; refusing new requests")
        self.error = self.error or error  # the first cause: a lost worker (`_lost`) fails the step it was in
        self._drop_all(EngineFailed(f"the engine failed: {self.error}"))

    def _lost(self, message: str) -> None:
        """A tensor-parallel worker exited or hung (the executor's watchdog
        calls this on its own thread): refuse new requests (`alive` is
        False: /health answers 503) and fail those in flight now, from
        here, since the engine thread may be blocked in a collective with
        that worker; it aborts them too once free, which also catches one
        it added meanwhile."""
        self.error = RuntimeError(message)
        error = EngineFailed(f"the engine failed: {message}")
        for live in self._live.copy().values():  # dict.copy is one C call: safe beside the engine thread
            self._deliver(live.queue.put_nowait, error)  # (a second error later is never read)
        try:
            self._put(lambda: self._drop_all(error))
        except EngineFailed:  # the loop has stopped
            pass

    def _close(self) -> None:
        self._drop_all(EngineFailed("the server is shutting down"))

    def _drop_all(self, error: Exception) -> None:
        for request_id, live in list(self._live.items()):
            self._deliver(live.queue.put_nowait, error)
            try:
                self.engine.abort(request_id)
            except Exception:  # already gone, or the engine is broken
                pass
        self._live.clear()

    def snapshot(self, engine: Engine) -> dict:
        """Engine and server counters (call through `call`, on the engine thread)."""
        stats = dict(engine.stats)
        cache = engine.kv.stats
        stats.update(kv_free_pages=engine.kv.num_free_pages, kv_total_pages=engine.kv.num_total_pages,
                     group_kinds=list(cache.group_kinds), capped_tokens=list(cache.capped_tokens),
                     evictions_by_reason={r: list(v) for r, v in cache.evictions_by_reason.items()},
                     aborted=self.num_aborted, rejected=self.num_rejected)
        return stats


_NOTHING = object()


def prompt_token_ids(tokenizer, prompt: str | list[int] | Callable) -> list[int]:
    """A request's prompt as token ids: text encoded, `fn(tokenizer)` (a chat
    template) called, token ids passed through (the engine checks them)."""
    if callable(prompt):
        return prompt(tokenizer)
    if not isinstance(prompt, str):
        return prompt
    if tokenizer is None:
        raise ValueError("this model folder has no tokenizer: give prompts as lists of token ids")
    if not prompt:
        raise ValueError("empty prompt: a request needs at least one token")
    return list(tokenizer.encode(prompt))


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _hand_out(batch) -> None:
    for queue_, update in batch:
        queue_.put_nowait(update)
