"""Next tokens from logits: greedy, temperature, top-k, top-p, per-request
generators (a request's seed fixes its tokens whatever else is batched)."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on one row of float32 logits."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default: torch.Generator) -> list[int | None]:
    """One token per row of `logits` [rows, vocab] (float32); None for a row
    whose logits are not all finite (a broken model: the caller fails that
    request alone)."""
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    out: list[int | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy and finite[i]]
    if greedy:
        picks = logits[greedy].argmax(dim=-1).tolist()
        for i, token in zip(greedy, picks):
            out[i] = token
    for i, p in enumerate(params):
        if p.greedy or not finite[i]:
            continue
        probs = torch.softmax(_filter(logits[i], p), dim=-1)
        generator = generators[i] or default
        if generator.device != probs.device:
            probs = probs.to(generator.device)
        out[i] = int(torch.multinomial(probs, 1, generator=generator).item())
    return out
