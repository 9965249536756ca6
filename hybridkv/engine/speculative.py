"""Speculative decoding by prompt lookup: draft tokens without a draft model,
and the acceptance rule that keeps the output distribution unchanged.

Drafts. The last n tokens of a sequence (n from `max_n` down to `min_n`)
are looked up among its earlier tokens; at the latest earlier occurrence,
the tokens that followed it are proposed. Text that quotes or edits its
prompt repeats long runs of it, and then the drafts are right. The index
maps each n-gram to the end of its latest occurrence and grows by the new
tokens only: work per new token, never per token of the sequence.

Verification. The engine computes the sampled token and the k drafts in one
pass, which gives k + 1 rows of logits: row i predicts what follows draft i
(row 0: what follows the sampled token). Greedy: drafts are accepted while
each equals its row's argmax, and the argmax of the first row not matched
is the bonus token, so the tokens are exactly those of one-token steps.
Sampling: a draft proposed with certainty is accepted with the target
probability p(draft); on the first rejection the token is drawn from p with
the draft taken out (renormalised), which is the residual max(0, p - q) of
rejection sampling for a one-hot q; if all k are accepted the bonus is drawn
from the last row. Each emitted token is thus distributed as p, whatever the
drafts (the proof is the standard one for speculative sampling).
"""

from __future__ import annotations

import numpy as np
import torch

from .sampler import _filtered_probabilities, _needs_sort
from .sampling_params import SamplingParams
from .seeding import pick


class PromptLookup:
    """One sequence's n-gram index and its drafts.

    Back-off: a verified step costs more than a one-token step (on a CPU,
    k + 1 rows through every matmul), so where drafts keep failing the
    sequence stops proposing for a while: after a step that kept no draft,
    for 2, 4, 8, then 16 steps; a step that keeps one ends the back-off. A
    run of bad guesses thus costs a few percent at most, and text that
    starts quoting again is found within 16 tokens."""

    MAX_BACKOFF = 16

    def __init__(self, min_n: int = 1, max_n: int = 3):
        self.min_n = min_n
        self.max_n = max_n
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0  # n-grams ending at or before this position are in `latest`
        self.misses = 0  # verified steps in a row that kept no draft
        self.wait = 0  # steps left without drafts

    def record(self, accepted: int) -> None:
        """The outcome of the step that verified this sequence's drafts."""
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.wait = min(1 << self.misses, self.MAX_BACKOFF)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the
        longest suffix of `tokens` (of min_n..max_n tokens) seen before.
        (Call once per step: a step in back-off counts here.)"""
        end = len(tokens)
        if k <= 0:
            return []
        if self.wait:
            self.wait -= 1
            return []
        # Index n-grams ending before `end`: the one ending at `end` is the
        # suffix to look up, and must not find itself.
        latest = self.latest
        for e in range(self.indexed + 1, end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                latest[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = latest.get(tuple(tokens[end - n:]))
            if at is not None:
                return tokens[at:at + k]
        return []


def accept_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                  stream: np.random.Generator | None, default: np.random.Generator) -> list[int] | None:
    """The tokens a verified step emits: the accepted drafts, then one more
    (the bonus, or the replacement of the first rejected draft). `logits`
    [len(drafts) + 1, vocab] (float32, or bfloat16: widened here). None if
    a row needed is not finite. Draws come from the request's own stream,
    or `default` (seeding.py)."""
    logits = logits.float()
    k = len(drafts)
    if params.greedy:
        best, picks = logits.max(dim=-1)
        targets = picks.tolist()
        accepted = 0
        while accepted < k and targets[accepted] == drafts[accepted]:
            accepted += 1
        if not torch.isfinite(best[:accepted + 1]).all():
            return None
        return drafts[:accepted] + [targets[accepted]]
    if not torch.isfinite(logits).all():
        return None
    vocab = logits.shape[-1]
    probs, order = _filtered_probabilities(logits, [params] * (k + 1), _needs_sort(params, vocab))
    if order is not None:  # back to vocabulary order
        probs = torch.zeros_like(probs).scatter_(1, order, probs)
    rng = stream if stream is not None else default
    draws = rng.random(k).tolist()
    out = []
    for i, draft in enumerate(drafts):
        p = probs[i]
        if draws[i] < float(p[draft]):
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0
        if not residual.sum() > 0:  # p(draft) was 1 up to rounding
            out.append(draft)
            continue
        out.append(int(pick(residual[None], [rng.random()])[0]))
        return out
    out.append(int(pick(probs[k:], [rng.random()])[0]))
    return out
