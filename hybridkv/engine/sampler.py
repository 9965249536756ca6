"""Next tokens from logits, for the whole batch at once: greedy rows from
one max over the batch, the others through temperature, top-k and top-p as
batched tensor ops, then one draw per row: a uniform number, turned into a
token by the row's cumulative probabilities (seeding.py). A request with a
seed draws from its own stream (its tokens do not depend on what else is
batched); the rest share the engine's stream.

Cost matters here: a 262,144-word vocabulary makes a batch-64 logits tensor
67 MB, and a pass over it costs as much as a layer of the model on the CPU.
So greedy rows take one pass (the max gives the token and tells whether the
row is finite) over the logits as the model gave them (a bfloat16 model's
in bfloat16, half the bytes), and a sort happens only for rows that ask for
top-k/top-p.
"""

from __future__ import annotations

import numpy as np
import torch

from .sampling_params import SamplingParams
from .seeding import pick


def _needs_sort(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0


def _filtered_probabilities(logits: torch.Tensor, params: list[SamplingParams], sort: bool):
    """(probabilities, order): rows of `logits` after temperature and, when
    `sort`, top-k and top-p, as probabilities over `order`'s columns (None:
    all columns, unsorted)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]
    if not sort:
        return torch.softmax(logits, dim=-1), None
    vocab = logits.shape[-1]
    ranked, order = torch.sort(logits, dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
    keep = torch.arange(vocab, device=logits.device)[None, :] < top_k[:, None]
    ranked = ranked.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ranked, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p.
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=logits.device)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    return torch.softmax(ranked.masked_fill(drop, float("-inf")), dim=-1), order


def _draw(logits, rows, params, streams, default, sort) -> list[int]:
    """Tokens for `rows` of `logits`, all filtered the same way (a row's
    token must not depend on which other rows are drawn with it)."""
    chosen = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
    probs, order = _filtered_probabilities(chosen.float(), [params[i] for i in rows], sort)
    shared = [j for j, i in enumerate(rows) if streams[i] is None]
    uniforms = np.empty(len(rows))
    uniforms[shared] = default.random(len(shared))
    for j, i in enumerate(rows):
        if streams[i] is not None:
            uniforms[j] = streams[i].random()
    choice = pick(probs, uniforms)
    if order is not None:
        choice = order.gather(1, choice[:, None])[:, 0]
    return choice.tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], streams: list[np.random.Generator | None],
           default: np.random.Generator, row_max=None) -> list[int | None]:
    """One token per row of `logits` [rows, vocab] (float32, or bfloat16:
    the greedy pick reads them as they are, rows drawn from are widened
    first); None for a row
    whose logits are not all finite (a broken model: the caller fails that
    request alone). `streams[r]`: row r's own random stream (a seeded
    request), or None to draw from `default` (seeding.py). `row_max`: the
    backend's (values, first indices) of each row's largest logit (its
    `row_max`), torch's max by default."""
    best, picks = logits.max(dim=-1) if row_max is None else row_max(logits)  # NaN or +inf anywhere: not finite
    finite = torch.isfinite(best).tolist()
    out: list[int | None] = [token if ok else None for token, ok in zip(picks.tolist(), finite)]
    vocab = logits.shape[-1]
    for sort in (False, True):
        rows = [i for i, p in enumerate(params) if not p.greedy and finite[i] and _needs_sort(p, vocab) == sort]
        if rows:
            for i, token in zip(rows, _draw(logits, rows, params, streams, default, sort)):
                out[i] = token
    return out
