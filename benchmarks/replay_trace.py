"""The traces the manager benchmarks replay (manager_overhead.py,
vllm_replay.py, kv_event_wire.py), the model configs they replay them on,
and the waiting queue both replay loops share: one module both sides
import, so neither imports the other.

A trace is a list of `TraceRequest`s in arrival order. A request with
`after` set is a later turn of a chat: it arrives when the request it
follows has finished, and its prompt is that request's prompt, the tokens
the replay decoded for it (`generated`) and new text.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
CONFIGS = {"full-only (Llama-3.1-8B)": "llama-3.1-8b.json", "Gemma-3-27B": "gemma-3-27b.json",
           "Jamba-1.5-Mini": "jamba-1.5-mini.json", "Qwen3-Next-80B-A3B": "qwen3-next-80b-a3b.json",
           "Nemotron-H-8B": "nemotron-h-8b.json"}
VOCAB = 32000


@dataclass(frozen=True)
class TraceRequest:
    tokens: list[int]
    outputs: int  # tokens to decode
    samples: list[int]  # the decoded tokens cycle through these (see `generated`)
    after: int | None = None  # index of the request this one follows (the previous turn of its chat)


def generated(outputs: int, samples: list[int]) -> list[int]:
    """The tokens a replay decodes for a request: with `left` tokens still
    to go, the next one is samples[left % 8], in both replay loops."""
    return [samples[left & 7] for left in range(outputs, 0, -1)]


def make_trace(num_requests: int, seed: int = 0, prompt=(200, 2000), output=(50, 500), shared=500,
               share=0.7) -> list[TraceRequest]:
    """Independent requests: prompts of `prompt` tokens, `share` of them
    opening with one `shared`-token system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(shared)]
    trace = []
    for _ in range(num_requests):
        length = rng.randint(*prompt)
        if rng.random() < share and length > shared:
            tokens = system + [rng.randrange(1, VOCAB) for _ in range(length - shared)]
        else:
            tokens = [rng.randrange(1, VOCAB) for _ in range(length)]
        trace.append(TraceRequest(tokens, rng.randint(*output), [rng.randrange(1, VOCAB) for _ in range(8)]))
    return trace


def make_chats(num_requests: int, seed: int = 0, turns=(2, 8), first=(300, 1500), message=(20, 400),
               output=(50, 400), system=400) -> list[TraceRequest]:
    """Multi-turn chats: each turn's prompt is the previous turn's prompt,
    its answer and a new user message of `message` tokens (unique text), so
    a turn can reuse everything before its new message, if the cache kept
    the state at the previous turn's end. Every chat opens with one
    `system`-token system prompt; first turns arrive together."""
    rng = random.Random(seed)
    header = [rng.randrange(1, VOCAB) for _ in range(system)]
    chats, count = [], 0
    while count < num_requests:
        tokens = header + [rng.randrange(1, VOCAB) for _ in range(rng.randint(*first))]
        chat = []
        for turn in range(rng.randint(*turns)):
            if turn:
                before = chat[-1]
                tokens = (before.tokens + generated(before.outputs, before.samples)
                          + [rng.randrange(1, VOCAB) for _ in range(rng.randint(*message))])
            chat.append(TraceRequest(tokens, rng.randint(*output), [rng.randrange(1, VOCAB) for _ in range(8)]))
        chats.append(chat)
        count += len(chat)
    trace = [chat[0] for chat in chats]  # the first turns arrive together ...
    for start, chat in enumerate(chats):  # ... each later turn follows the one before it
        prev = start
        for request in chat[1:]:
            trace.append(TraceRequest(request.tokens, request.outputs, request.samples, after=prev))
            prev = len(trace) - 1
    return trace[:num_requests]  # a turn always comes after the one it follows: the cut keeps every `after`


def make_shared_system(num_requests: int, seed: int = 0, systems=8, system=(800, 3000), question=(20, 200),
                       output=(20, 300)) -> list[TraceRequest]:
    """Requests that open with one of `systems` long system prompts (an
    agent's tools, a RAG preamble) and end with a short unique question."""
    rng = random.Random(seed)
    headers = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(*system))] for _ in range(systems)]
    return [TraceRequest(rng.choice(headers) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(*question))],
                         rng.randint(*output), [rng.randrange(1, VOCAB) for _ in range(8)])
            for _ in range(num_requests)]


def make_send_twice(num_requests: int, seed: int = 0, prompt=(1000, 4000), output=(20, 200),
                    lanes=8) -> list[TraceRequest]:
    """Long prompts that share nothing, each sent again as soon as its first
    send has finished (a regenerated answer, a retried call), by `lanes`
    clients, each sending its next prompt once the last one came back
    twice: the second send can hit all but the prompt's last block, if the
    cache kept the state at its end (vLLM 0.32 misses until the third send
    on hybrids, vllm#45238)."""
    rng = random.Random(seed)
    trace: list[TraceRequest] = []
    last: list[int | None] = [None] * lanes  # each lane's latest request
    while len(trace) < num_requests:
        lane = len(trace) // 2 % lanes
        tokens = [rng.randrange(1, VOCAB) for _ in range(rng.randint(*prompt))]
        for _ in range(2):
            trace.append(TraceRequest(tokens, rng.randint(*output), [rng.randrange(1, VOCAB) for _ in range(8)],
                                      after=last[lane]))
            last[lane] = len(trace) - 1
    return trace[:num_requests]  # a request always comes after the one it follows: the cut keeps every `after`


TRACES = {"mixed": make_trace, "multi-turn": make_chats, "shared-system": make_shared_system,
          "send-twice": make_send_twice}


def trace_named(name: str, num_requests: int) -> list[TraceRequest]:
    """One of TRACES, or "unique-L": `num_requests` independent prompts of
    exactly L tokens sharing nothing, with 20 tokens out each (replayed at a
    few lengths, it splits a manager's cost per admission into a part per
    request and a part per block). ValueError for another name."""
    if name in TRACES:
        return TRACES[name](num_requests)
    kind, _, length = name.partition("-")
    if kind == "unique" and length.isdigit() and int(length) > 0:
        return make_trace(num_requests, prompt=(int(length), int(length)), output=(20, 20), share=0.0)
    raise ValueError(f"unknown trace {name!r}: expected one of {', '.join(TRACES)} or unique-L (L tokens)")


class Waiting:
    """The FCFS waiting queue of a replay: `head()` is the next request to
    admit, `admitted()` removes it, `requeue()` puts a preempted request
    back at the head, and `finished(rid)` lets the turns that follow rid
    arrive (at the tail)."""

    def __init__(self, trace: list[TraceRequest]):
        self._queue: list[tuple] = []  # reversed: the head is at the end
        self._followers: dict[str, list[tuple]] = {}
        for i, request in enumerate(trace):
            entry = (f"r{i}", list(request.tokens), request.outputs, request.samples)
            if request.after is None:
                self._queue.append(entry)
            else:
                self._followers.setdefault(f"r{request.after}", []).append(entry)
        self._queue.reverse()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def head(self) -> tuple:
        return self._queue[-1]

    def admitted(self) -> None:
        self._queue.pop()

    def requeue(self, entry: tuple) -> None:
        self._queue.append(entry)

    def finished(self, rid: str) -> None:
        for entry in self._followers.pop(rid, ()):
            self._queue.insert(0, entry)
