"""A step as plain arrays (`StepPlan`): what the driver hands its workers,
all a worker needs to run the step, in process or on another rank
(plan_wire.py sends it as one int64 tensor).

The driver builds it (`plan_step`) from the scheduler's steps and each
sequence's table row; the engine adds what must happen before the forward
pass: page copies (forks' copy-on-write), table changes, the drafts the
last step kept, the tier copies (core/tiers.py `TierPlan`), the
recurrent states to save inside prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.tiers import TierPlan
from .scheduler import Scheduled


@dataclass
class StepPlan:
    ids: np.ndarray  # [T] token ids, sequence after sequence
    first_positions: np.ndarray  # [S]
    counts: np.ndarray  # [S] tokens of each sequence in this step
    rows: np.ndarray  # [S] each sequence's table row
    verifying: np.ndarray | None  # [S] bool, or None: no sequence verifies drafts
    sampled: np.ndarray  # token rows whose logits are sampled
    decode: bool = False  # one token per sequence, each sampled: the worker may take its fixed-shape path
    copies: list = field(default_factory=list)  # (source page, destination page) to copy first
    table_changes: list = field(default_factory=list)  # tables.TableRows.changes()
    accepted: dict | None = None  # the previous plan's kept drafts by sequence index (Worker.keep_accepted)
    tiers: TierPlan | None = None  # the tier copies to make first
    # Recurrent states saved at checkpoints inside prefill chunks: (sequence
    # index, tokens of its chunk before the checkpoint, group, pages).
    checkpoint_saves: list = field(default_factory=list)
    # Prompt logprobs (SamplingParams.prompt_logprobs): token rows whose logits
    # are reduced to the logprob of the next prompt token (`logprob_tokens`)
    # and the `logprob_top` most likely tokens' (the most any of them asks).
    logprob_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    logprob_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    logprob_top: int = 0


def plan_step(steps: list[Scheduled], rows: list[int]) -> StepPlan:
    """The scheduled steps' tokens, positions and sampled rows."""
    n = len(steps)
    counts = np.fromiter((s.count for s in steps), dtype=np.int64, count=n)
    first_positions = np.fromiter((s.start for s in steps), dtype=np.int64, count=n)
    table_rows = np.asarray(rows, dtype=np.int64)
    if all(s.count == 1 and s.completes for s in steps):  # decodes: one token, one sampled row each
        ids = np.fromiter((s.seq.token_ids[s.start] for s in steps), dtype=np.int64, count=n)
        return StepPlan(ids, first_positions, counts, table_rows, None, np.arange(n, dtype=np.int64), decode=True)
    ids = np.fromiter((t for s in steps for t in (s.seq.token_ids[s.start:s.start + s.count - len(s.drafts)]
                                                  + s.drafts)),
                      dtype=np.int64, count=int(counts.sum()))
    verifying = np.fromiter((bool(s.drafts) for s in steps), dtype=bool, count=n)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    sampled = []
    scored, targets, top = [], [], 0
    for i, s in enumerate(steps):
        if s.drafts:  # every token of a verified step gives a row: what follows it
            sampled.extend(range(int(starts[i]), int(starts[i] + counts[i])))
        elif s.completes:
            sampled.append(int(starts[i] + counts[i] - 1))
        positions = s.seq.request.scored_positions(s.start, s.count)
        if positions:  # a prompt chunk of a request that wants prompt logprobs
            first = int(starts[i]) - s.start
            scored.extend(range(first + positions.start, first + positions.stop))
            targets.extend(s.seq.request.prompt_token_ids[positions.start + 1:positions.stop + 1])
            top = max(top, s.seq.request.params.prompt_logprobs)
    plan = StepPlan(ids, first_positions, counts, table_rows, verifying if verifying.any() else None,
                    np.asarray(sampled, dtype=np.int64))
    if scored:
        plan.logprob_rows = np.asarray(scored, dtype=np.int64)
        plan.logprob_tokens = np.asarray(targets, dtype=np.int64)
        plan.logprob_top = top
    return plan
