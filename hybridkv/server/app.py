"""The FastAPI app: OpenAI's completions, chat completions and models
endpoints, plus /health and /metrics, over an engine client: one EngineLoop here
(LocalEngine), or engine replicas on Ray Serve (hybridkv/serving/ray.py).

Handlers run on the event loop and never touch the engine: they read the
body (refused with 413 past its bound, before it is read), parse it (a body
past a few KiB in a worker thread; past its bounds refused with 400),
refuse text too long for any prompt that fits the context, tokenize in a
worker thread (neither the event loop nor the engine's thread waits for a
large prompt), hand the token ids to the engine client, and turn its
updates into OpenAI responses or server-sent events. A client that goes
away aborts its request.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..engine.engine import check_prompt_length
from ..engine.engine_loop import EngineFailed, EngineLoop, Overloaded, RequestStream, Update, prompt_token_ids
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, bad_request, body_limit, longest_text,
                       parse, too_large, too_long)

log = logging.getLogger("hybridkv.server")


class _Completion:
    """The shapes of /v1/completions."""
    kind, chunk_kind = "text_completion", "text_completion"

    def __init__(self, request_id: str, created: int, model: str):
        self.head = {"id": request_id, "object": self.kind, "created": created, "model": model}

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict:
        return {**self.head, "object": self.chunk_kind,
                "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


class _Chat(_Completion):
    """The shapes of /v1/chat/completions."""
    kind, chunk_kind = "chat.completion", "chat.completion.chunk"

    def chunk(self, index: int, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {**self.head, "object": self.chunk_kind,
                "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def choice(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}


def _usage(update: Update) -> dict:
    return {"prompt_tokens": update.prompt_tokens, "completion_tokens": update.completion_tokens,
            "total_tokens": update.prompt_tokens + update.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": update.cached_tokens}}


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_type(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")


class LocalEngine:
    """The app's engine client for one engine in this process: an EngineLoop
    (its thread owns the engine) and the Prometheus metrics of that engine.

    An engine client is what `create_app` needs: `max_model_len` and `tokenizer`
    (once started), `alive` and `error` (why not, or None), `start()` and `stop()` (the app's lifespan),
    `submit(token_ids, ...)` (a stream of `Update`s, or ValueError /
    Overloaded / EngineFailed / APIError) and `metrics()` (Prometheus text).
    hybridkv/serving/ray.py has the other one: engine replicas on Ray Serve."""

    def __init__(self, engine: Engine, max_waiting: int = 512, kv_publisher=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # used by the app's worker threads and the engine's (thread-safe)
        self.server_metrics = ServerMetrics()
        self.kv_publisher = kv_publisher
        self.engine_loop = EngineLoop(engine, max_waiting=max_waiting, ttft_histogram=self.server_metrics.ttft,
                                      kv_publisher=kv_publisher)
        self.max_model_len = engine.max_model_len

    @property
    def alive(self) -> bool:
        return self.engine_loop.alive

    @property
    def error(self) -> BaseException | None:
        return self.engine_loop.error

    async def start(self) -> None:
        self.engine_loop.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine_loop.shutdown)
        if self.kv_publisher is not None:
            await asyncio.to_thread(self.kv_publisher.close)
        # The engine thread has stopped: keep what the pool caches on the disk tier.
        await asyncio.to_thread(self.engine.close)

    async def submit(self, prompt, params, request_id, *, stream: bool = False, **options) -> RequestStream:
        return await self.engine_loop.submit(prompt, params, request_id, **options)

    async def metrics(self) -> bytes:
        snapshot = await self.engine_loop.call(self.engine_loop.snapshot)
        return self.server_metrics.render(snapshot)


def build_app(engine: Engine, *, model_name: str, api_key: str | None = None, max_waiting: int = 512,
              kv_events: str | None = None, kv_events_replay: str | None = "next-port",
              kv_events_topic: str = "", max_body_bytes: int | None = None,
              max_prompt_chars: int | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`. The engine thread starts and
    stops with the app's lifespan; the app owns the engine from then on.
    `max_body_bytes`, `max_prompt_chars`: see create_app.

    `kv_events`: publish the engine's KV events on a ZMQ PUB socket bound
    there (e.g. "tcp://*:5557"; kv_events/zmq_stream.py), with a replay socket
    at `kv_events_replay` ("next-port": the endpoint's port + 1; None: no
    replay). The engine must be made with enable_kv_events=True. The sockets
    are bound here, so a taken port fails before the server starts."""
    publisher = None
    if kv_events is not None:
        publisher = _kv_event_publisher(engine, kv_events, kv_events_replay, kv_events_topic)
    engine_client = LocalEngine(engine, max_waiting, kv_publisher=publisher)
    app = create_app(engine_client, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                     max_prompt_chars=max_prompt_chars)
    app.state.engine_loop = engine_client.engine_loop
    app.state.metrics = engine_client.server_metrics
    if publisher is not None:
        description = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                       "topic": kv_events_topic, "medium": publisher.wire.medium,
                       "hash_function": engine.kv.hasher.name, "layout": engine.kv.layout.to_dict()}

        @app.get("/kv_events")
        async def kv_event_stream():
            """Where the KV events are published, and the layout a router
            needs to apply the hit rule to them (docs/server.md)."""
            return description
    return app


def _kv_event_publisher(engine: Engine, endpoint: str, replay: str | None, topic: str):
    from ..kv_events.wire import WireFormat
    from ..kv_events.zmq_stream import KVEventPublisher, next_port_endpoint

    if engine.kv.block_cache.events is None:
        raise ValueError("kv_events needs an engine made with enable_kv_events=True")
    if replay == "next-port":
        replay = next_port_endpoint(endpoint)
    medium = "GPU" if engine.device.type == "cuda" else "CPU"  # where the engine's pool lives
    return KVEventPublisher(endpoint, WireFormat(engine.kv.layout, medium=medium), replay_endpoint=replay,
                            topic=topic)


# Prompts of more characters are tokenized by two threads of low priority
# (Linux: the thread's nice value), so that on a busy machine they take
# the CPU the engine's thread leaves: on 2 cores beside other work, small
# requests beside a 2.9M-character prompt took 56 ms (median) this way
# and 118 ms at the same priority, against 20-60 ms idle.
LARGE_PROMPT_CHARS = 1 << 16


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


_LARGE_PROMPTS = ThreadPoolExecutor(2, thread_name_prefix="hybridkv-large-prompt", initializer=_lower_priority)

# A body up to this size is parsed on the event loop (a few milliseconds at
# most); a larger one in a worker thread, and one larger than
# LARGE_PROMPT_CHARS in the large prompts' low-priority threads: parsing a
# body and building what it asks for (a chat's messages, the stop strings'
# automaton) take time in proportion to its size, and the loop serves the
# others meanwhile wherever that work lets go of the GIL (protocol.parse
# bounds what does not: pydantic's and json.loads' work).
SMALL_BODY_BYTES = 1 << 12


def create_app(engine_client, *, model_name: str, api_key: str | None = None, max_body_bytes: int | None = None,
               max_prompt_chars: int | None = None) -> FastAPI:
    """The OpenAI-compatible app over an engine client (see LocalEngine).
    `max_prompt_chars`: a text prompt (or the messages' text) longer than
    this is refused with 400 before it is tokenized (default: the longest
    text that can fit the context, protocol.longest_text).
    `max_body_bytes`: a larger body is refused with 413 before it is read
    (default: room for the longest prompt that can fit, protocol.body_limit)."""
    started = int(time.time())
    limits: dict[str, int | None] = {}

    def limit(name: str) -> int | None:
        """The bounds, set once the engine client knows its model (at start)."""
        if not limits:
            chars = max_prompt_chars if max_prompt_chars is not None else \
                longest_text(engine_client.tokenizer, engine_client.max_model_len)
            body = max_body_bytes if max_body_bytes is not None else body_limit(chars, engine_client.max_model_len)
            limits.update(prompt_chars=chars, body_bytes=body)
        return limits[name]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine_client.start()
        limit("body_bytes")
        # What start-up built (the model's modules, the tokenizer: hundreds
        # of thousands of objects) lives as long as the server: kept out of
        # the collector's reach, so that a full collection, which holds
        # every thread, no longer walks it.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await engine_client.stop()

    app = FastAPI(title="hybridkv", lifespan=lifespan)

    # -- errors in OpenAI's shape --------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # unknown paths, wrong methods
        return JSONResponse(APIError(e.status_code, str(e.detail), _error_type(e.status_code)).body(),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", "server_error").body(), status_code=500)

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           "authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    async def read_body(request: Request) -> bytes:
        bound = limit("body_bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > bound:
            raise too_large(int(declared), bound)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > bound:
                raise too_large(size, bound)
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_request(request: Request, read):
        """`read(body)`: the body parsed and turned into what the handler
        needs, on the event loop or in a worker thread (SMALL_BODY_BYTES)."""
        body = await read_body(request)
        if len(body) <= SMALL_BODY_BYTES:
            return read(body)
        pool = _LARGE_PROMPTS if len(body) > LARGE_PROMPT_CHARS else None
        return await asyncio.get_running_loop().run_in_executor(pool, read, body)

    async def token_ids(prompt, characters: int, param: str) -> list[int]:
        """The prompt's token ids. Text (or a chat template) is tokenized in
        a worker thread (a large prompt in one of low priority): the
        tokenizer leaves the GIL while it works, so other requests go on
        meanwhile."""
        bound = limit("prompt_chars")
        if bound is not None and characters > bound:
            raise too_long(characters, bound, engine_client.max_model_len, param)
        try:
            if isinstance(prompt, list):
                ids = prompt
            else:
                pool = _LARGE_PROMPTS if characters > LARGE_PROMPT_CHARS else None
                ids = await asyncio.get_running_loop().run_in_executor(pool, prompt_token_ids, engine_client.tokenizer,
                                                                       prompt)
            check_prompt_length(len(ids), engine_client.max_model_len)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return ids

    async def submit(prompt, characters: int, param: str, params, request_id, **options) -> RequestStream:
        ids = await token_ids(prompt, characters, param)
        try:
            return await engine_client.submit(ids, params, request_id, **options)
        except ValueError as e:
            raise bad_request(str(e)) from None
        except Overloaded as e:
            raise APIError(503, str(e), "server_error", code="overloaded") from None
        except EngineFailed as e:
            raise APIError(500, str(e), "server_error") from None

    # -- endpoints -----------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine_client.alive:
            error = engine_client.error  # a failed step, or a tensor-parallel worker gone or hung
            raise APIError(503, f"the engine failed: {error}" if error is not None else
                           "the engine loop is not running", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(await engine_client.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "hybridkv", "max_model_len": engine_client.max_model_len}]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: Request):
        def read(body: bytes):
            req = parse(CompletionRequest, body)
            check_model(req.model)
            return req, req.single_prompt(), req.sampling_params(req.max_tokens), req.text_length()

        req, prompt, params, characters = await read_request(request, read)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(prompt, characters, "prompt", params, request_id, cache_salt=req.cache_salt,
                              stream=req.stream)
        shape = _Completion(request_id, int(time.time()), model_name)
        return await respond(request, req, stream, shape)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(request: Request):
        def read(body: bytes):
            req = parse(ChatCompletionRequest, body)
            check_model(req.model)
            # max tokens None: what fits the KV cache and the context
            return req, req.prompt(), req.sampling_params(req.token_limit()), req.text_length()

        req, prompt, params, characters = await read_request(request, read)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(prompt, characters, "messages", params, request_id, cache_salt=req.cache_salt,
                              stream=req.stream)
        shape = _Chat(request_id, int(time.time()), model_name)
        return await respond(request, req, stream, shape)

    async def respond(request: Request, req, stream: RequestStream, shape: _Completion):
        if req.stream:
            return StreamingResponse(events(stream, shape, req.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **stream.headers})
        texts: dict[int, list[str]] = {i: [] for i in range(req.n)}
        reasons: dict[int, str | None] = {}
        last = await until_done(request, stream, texts, reasons)
        if last is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        body = {**shape.head, "choices": [shape.choice(i, "".join(texts[i]), reasons.get(i)) for i in texts],
                "usage": _usage(last)}
        return JSONResponse(body, headers=stream.headers)

    return app


async def until_done(request: Request, stream: RequestStream, texts, reasons) -> Update | None:
    """Collect a request's updates; None (and the request aborted) if the
    client disconnects first."""

    async def collect() -> Update:
        last = None
        async for update in stream:
            for d in update.deltas:
                texts[d.index].append(d.text)
                if d.finish_reason is not None:
                    reasons[d.index] = d.finish_reason
            last = update
        return last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left, or this handler was cancelled
            work.cancel()
            stream.abort()
    if work not in done:
        return None
    try:
        return work.result()
    except EngineFailed as e:
        raise APIError(500, str(e), "server_error") from None


async def events(stream: RequestStream, shape: _Completion, include_usage: bool):
    """Server-sent events in OpenAI's chunk format, then [DONE]. If the client
    disconnects, the response task is cancelled inside this generator and the
    `finally` aborts the request."""
    started: set[int] = set()
    last = None
    try:
        async for update in stream:
            last = update
            for d in update.deltas:
                first = d.index not in started
                started.add(d.index)
                chunk = shape.chunk(d.index, d.text, d.finish_reason, first)
                if include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
        if include_usage and last is not None:
            yield _sse({**shape.head, "object": shape.chunk_kind, "choices": [], "usage": _usage(last)})
    except EngineFailed as e:
        yield _sse(APIError(500, str(e), "server_error").body())
    except APIError as e:  # an engine client's own error (a Ray replica that died mid-stream)
        yield _sse(e.body())
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"
