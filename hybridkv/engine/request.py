"""A request and its sequences, as the engine tracks them."""

from __future__ import annotations

import enum

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestMetrics
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One continuation of a prompt: what the scheduler schedules and the
    KV cache manager holds blocks for (under `seq_id`).

    Its token ids (prompt + generated) are the manager's list, read here,
    never copied: the scheduler sets `token_ids` when it hands the sequence
    to the manager, and sampled tokens join through the manager."""

    def __init__(self, seq_id: str, request: "Request", index: int, stream):
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids: list[int] = []  # the manager's list (set by the scheduler)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stream = stream  # a seeded request's own random stream (seeding.py), else None
        self.text: str | None = None  # set when a stop string cut it; else decoded at the end
        self.detokenizer: IncrementalDetokenizer | None = None  # for stop strings, made on first use
        self.stop_state = 0  # where the stop strings' automaton stands in the text (stop_strings.py)
        self.drafter = None  # speculative decoding: its n-gram index (speculative.PromptLookup), made on first use

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.cache_salt = cache_salt
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.sequences: list[Sequence] = []
        # n > 1: the n - 1 children are still to be made (once the prompt is computed)
        self.fork_pending = params.n > 1
        # SamplingParams.prompt_logprobs: the entries recorded so far (the first,
        # position 0's, is None); the prompt's chunks add theirs in order.
        self.prompt_logprobs: list[dict[int, float] | None] | None = \
            None if params.prompt_logprobs is None else [None]

    @property
    def reads_prefix_cache(self) -> bool:
        """A prefix hit skips computing its rows: a request that wants prompt
        logprobs takes none until it has them all (after a preemption it may)."""
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_token_ids)

    def scored_positions(self, start: int, count: int) -> range:
        """Of the positions [start, start + count) a step computes, those
        whose logits give a prompt logprob not recorded yet (position q's
        logits score prompt token q + 1; a recomputed position, after a
        preemption, is not scored twice)."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + count, len(self.prompt_token_ids) - 1))

    @property
    def finished(self) -> bool:
        return not self.fork_pending and all(s.status is Status.FINISHED for s in self.sequences)
