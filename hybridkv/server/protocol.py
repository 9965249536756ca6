"""The OpenAI request bodies the server accepts, and its error shape.

Bodies are parsed strictly: an unknown field, a wrong type or invalid JSON is
a 400 naming the field, never silently ignored. Values are checked by
`SamplingParams` and the engine, whose `ValueError` text becomes the message.
What a request may carry is bounded (messages, content parts, stop strings;
docs/server.md), and checked before pydantic builds the request (`parse`).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import SamplingParams
from ..engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_stop_bounds  # noqa: F401


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


MAX_N = 128
GREEDY_BELOW = 1e-5  # a smaller temperature is greedy in the limit, and overflows the softmax
# What one request may carry, far above what clients send: pydantic builds
# a message or a content part in about 5 us, holding the GIL throughout.
# The stop strings' bounds (MAX_STOP_STRINGS, MAX_STOP_CHARS) are
# SamplingParams' own, which the Python API checks too.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 2048  # all the messages' together
# JSON objects and arrays of a request within the bounds: a message and its
# list of parts, a part, and a few of the body's own (itself, stop, ...)
MAX_CONTAINERS = 2 * MAX_MESSAGES + MAX_CONTENT_PARTS + 8
BATCHED = "batched prompts are not supported: send one prompt per request"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted at their neutral values only (clients often send them)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # hybridkv extensions
    cache_salt: str | None = None  # prompts with different salts never share KV blocks
    ignore_eos: bool = False
    top_k: int = 0

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported (only 0)", name)
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        # Ranges the engine does not check and would fail on inside a step
        # (where an error stops the engine for everyone): temperatures whose
        # softmax overflows, seeds torch cannot take. n as OpenAI bounds it.
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be an integer in [1, {MAX_N}], got {self.n}", "n")
        if not 0 <= self.temperature <= 2:
            raise bad_request(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if self.seed is not None and not -2**63 <= self.seed < 2**63:
            raise bad_request(f"seed must be a signed 64-bit integer, got {self.seed}", "seed")
        temperature = self.temperature if self.temperature >= GREEDY_BELOW else 0.0
        try:
            return SamplingParams(n=self.n, temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                                  seed=self.seed, max_tokens=max_tokens, stop=self.stop,
                                  ignore_eos=self.ignore_eos)
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _fail_fast(kind):
    # A list in a union stops at its first wrong item: otherwise every
    # member reports every item (3.5 s for [1, "a"] * 200_000).
    return Annotated[kind, Field(fail_fast=True)]


class CompletionRequest(_Sampling):
    prompt: str | _fail_fast(list[int]) | _fail_fast(list[str]) | _fail_fast(list[list[int]])
    max_tokens: int = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False

    def text_length(self) -> int:
        """Characters of text in the prompt (0 for token ids)."""
        prompt = self.prompt[0] if isinstance(self.prompt, list) and len(self.prompt) == 1 else self.prompt
        return len(prompt) if isinstance(prompt, str) else 0

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(BATCHED, "prompt")
            prompt = prompt[0]
        if self.logprobs:
            raise bad_request("logprobs is not supported", "logprobs")
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_Sampling):
    messages: list[Message]
    max_tokens: int | None = None  # None: as many as fit the KV cache and the context
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = None

    def prompt(self):
        """The prompt's token ids as `fn(tokenizer)` (the app calls it in a worker thread)."""
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = [m.as_template_input() for m in self.messages]
        return lambda tokenizer: render_chat(tokenizer, messages)

    def text_length(self) -> int:
        """Characters of text in the messages (the template adds more)."""
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in m.content)
                   for m in self.messages)

    def token_limit(self) -> int | None:
        if self.logprobs:
            raise bad_request("logprobs is not supported", "logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both", "max_tokens")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's token ids. Control tokens written inside messages
    (say "<end_of_turn>") are encoded as plain text, so a user cannot forge
    turns; only the template's own control tokens count."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use /v1/completions with a prompt you format yourself")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            sanitize_control_tokens=True)
    except TemplateError as e:  # a template's raise_exception(...), e.g. roles must alternate
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    return list(ids)


def longest_text(tokenizer, max_model_len: int) -> int | None:
    """The most characters a text prompt that fits the context can have:
    `max_model_len` tokens, each as long as the longest in the vocabulary
    (a token's string has at least as many characters as its text). None
    without a tokenizer (text prompts are refused then)."""
    if tokenizer is None:
        return None
    return max_model_len * max(map(len, tokenizer.get_vocab()), default=1)


def body_limit(prompt_chars: int | None, max_model_len: int) -> int:
    """The default bound on a request body: room for the longest prompt
    that can fit, as text (4 bytes a character) or as token ids (8 bytes
    an id), and 1 MiB for the rest."""
    return max(4 * (prompt_chars or 0), 8 * max_model_len) + (1 << 20)


def too_long(characters: int, limit: int, max_model_len: int, param: str) -> APIError:
    return bad_request(f"the prompt has {characters} characters: more than any prompt that fits the model "
                       f"context of {max_model_len} tokens can have (at most {limit}; --max-prompt-chars)", param)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body of {size} bytes is over this server's limit of {limit} bytes "
                    f"(--max-body-bytes)", code="request_too_large")


def parse(model: type[BaseModel], body: bytes):
    """A request body, or a 400 naming what is wrong.

    What a body asks for is checked against the bounds before pydantic
    builds it: pydantic holds the GIL while it does, and so does json.loads,
    stopping every thread of the server, the event loop's and the engine's,
    even when the body is parsed in a worker thread (0.6 s for a body of
    130,000 messages; 0.8 s for 400,000 empty lists). So its objects and
    arrays are counted first, then json.loads reads a body of few of them
    for `check_bounds`, then pydantic builds the request."""
    # (the brackets' count is at least the containers': most bodies need no scan)
    if body.count(b"{") + body.count(b"[") > MAX_CONTAINERS and containers(body, MAX_CONTAINERS) > MAX_CONTAINERS:
        raise bad_request(f"the body has more than {MAX_CONTAINERS} JSON objects and arrays: more than a request "
                          f"within the bounds of {MAX_MESSAGES} messages and {MAX_CONTENT_PARTS} content parts has")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON: pydantic says why
        data = None
    check_bounds(data)
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}") from None
        # union members add their type name to the location: keep the field path
        where = ".".join(str(p) for p in err["loc"] if not _is_type_name(p))
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field {where!r}", where) from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field {where!r}", where) from None
        message = f"invalid value for {where!r}: {err['msg']}" if where else f"invalid request: {err['msg']}"
        raise bad_request(message, where or None) from None


# Text up to the next object or array (outside strings) and its bracket.
_TO_NEXT_CONTAINER = re.compile(rb'(?:[^"\[{]++|"(?:[^"\\]++|\\.)*+")*+[\[{]', re.DOTALL)


def containers(body: bytes, most: int) -> int:
    """The JSON objects and arrays in `body`, counted up to `most` + 1
    (where the count stops; so does it at JSON it cannot read). Python runs
    between one and the next, so another thread may take the GIL there."""
    count = end = 0
    while count <= most and (found := _TO_NEXT_CONTAINER.match(body, end)) is not None:
        count, end = count + 1, found.end()
    return count


def check_bounds(data) -> None:
    """A 400 naming the bound a request body (as json.loads reads it) passes."""
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise bad_request(f"at most {MAX_MESSAGES} messages; got {len(messages)}", "messages")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise bad_request(f"at most {MAX_CONTENT_PARTS} content parts in all messages together; got {parts}",
                              "messages")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
        raise bad_request(BATCHED, "prompt")  # before pydantic builds every prompt of the batch
    stop = data.get("stop")
    if isinstance(stop, list):
        try:
            check_stop_bounds(stop)
        except ValueError as e:
            raise bad_request(str(e), "stop") from None


def _is_type_name(part) -> bool:
    return isinstance(part, str) and (part in {"str", "int", "float", "bool"} or "[" in part
                                      or part[:1].isupper())
