"""What generate() and step() return."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class TokenIds(Sequence):
    """The output tokens of a running sequence, read from its live token
    list (no copy per step: a step's outputs cost the same at token 10 and
    at token 10,000). Compares equal to a list of the same ids."""

    __slots__ = ("_tokens", "_start")

    def __init__(self, tokens: list[int], start: int):
        self._tokens, self._start = tokens, start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._tokens[self._start + i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._tokens[self._start + index]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list once finished; a live view while running
    finish_reason: str | None  # "length" | "stop" | "abort"; None while running


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # kv_role "prefill": bytes of the blocks a hit of the prompt reads, shipped
    # to the shared directory (or there already), and of every layer's KV and
    # states for the same whole blocks (what shipping everything would take)
    kv_handoff_bytes: int = 0
    kv_all_layers_bytes: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs=k: one entry per prompt token, the first
    # None, then {token id: logprob} holding the prompt's token at that
    # position and the k most likely ones (vLLM's shape). Complete in every
    # output (a request's outputs begin once its prompt is computed); None
    # when not asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
