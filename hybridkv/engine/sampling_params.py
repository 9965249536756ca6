"""How to sample one request's continuation(s)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .stop_strings import StopStrings

GREEDY_BELOW = 1e-5  # temperatures this small sample greedily
# Bounds on stop strings, far above what clients send (OpenAI takes 4):
# they bound the automaton's memory (one node a character) and its build.
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 1 << 16  # all the stop strings together
# The most top tokens a prompt position reports (vLLM's default max_logprobs):
# each costs a column of a top-k over the vocabulary for every prompt row.
MAX_LOGPROBS = 20
# Clients send the same stop strings with request after request: their
# automaton is built once (30 ms at the bounds), and shared (it never changes).
_stop_strings = functools.lru_cache(maxsize=16)(StopStrings)


@dataclass
class SamplingParams:
    n: int = 1  # continuations per prompt (share the prompt's blocks)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens with this much probability
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # per-request generator: same seed, same tokens
    max_tokens: int | None = 16  # None: as many as fit the KV cache and the context (Engine.max_tokens_that_fit)
    stop: list[str] | str | None = None  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Prompt logprobs (vLLM's): for every prompt position p >= 1, the logprob
    # of the prompt's token there and of the k most likely tokens, in
    # RequestOutput.prompt_logprobs. None: off. Such a request computes its
    # whole prompt (it takes no prefix-cache hit; its blocks still serve others).
    prompt_logprobs: int | None = None
    # The automaton that finds the stop strings, built here (in the caller's
    # thread, never the engine's): read `stop` once, at construction.
    stop_strings: StopStrings = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        def integer(name, value, low):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

        integer("n", self.n, 1)
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", self.prompt_logprobs, 0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be at most {MAX_LOGPROBS} (top tokens per prompt position), "
                                 f"got {self.prompt_logprobs}")
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: no limit), got {self.top_k!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(1 << 63) <= self.seed < (1 << 63)):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63) or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a string or a list of non-empty strings")
        check_stop_bounds(self.stop)
        self.stop_strings = _stop_strings(tuple(self.stop))
        ids = list(self.stop_token_ids or [])
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        # Below this, dividing float32 logits overflows; the result is argmax anyway.
        return self.temperature < GREEDY_BELOW


def check_stop_bounds(stop: list) -> None:
    """ValueError naming the bound a stop list passes (its strings: str
    or not, as a request body has them before it is validated)."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings; got {len(stop)}")
    chars = sum(len(s) for s in stop if isinstance(s, str))
    if chars > MAX_STOP_CHARS:
        raise ValueError(f"stop: at most {MAX_STOP_CHARS} characters in all stop strings together; got {chars}")
