"""Where sampled tokens get their randomness: one stream per seeded
sequence, one per engine for every unseeded one.

A request's `seed` is a signed 64-bit integer, and every bit of it counts:
the stream of continuation i of a request seeded with s is numpy's PCG64
keyed by a SeedSequence over (s, i), which hashes all of its input. So
seeds s and s + k * 2**32 give different streams, and the children of an
n > 1 request get streams of their own rather than another seed's (child i
of seed s is not seed s + i). Continuation 0 of seed s is the same stream
whatever n is.

Unseeded requests share the engine's stream: fresh entropy from the
operating system at each engine start, so a restart does not repeat the
draws of the last run, unless the engine is given a seed (then runs with
the same requests in the same order draw the same). Requests' and engines'
streams are keyed apart, so no engine seed reproduces a request seed.

A draw is one uniform number per row; the sampler turns it into a token by
the row's cumulative probabilities (`pick`).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK = (1 << 64) - 1
_REQUEST, _ENGINE = 1, 2  # which kind of stream an entropy value keys


def _key(kind: int, seed: int) -> int:
    """The entropy of a stream: the kind above the seed's 64 bits (two's
    complement for negative seeds), so the two kinds never share a key."""
    return (kind << 64) | (seed & _MASK)


def request_stream(seed: int, index: int) -> np.random.Generator:
    """The stream of continuation `index` of a request seeded with `seed`."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(_key(_REQUEST, seed), spawn_key=(index,))))


def engine_stream(seed: int | None) -> np.random.Generator:
    """The stream of an engine's unseeded requests: fresh entropy, or
    `seed`'s stream when given."""
    entropy = None if seed is None else _key(_ENGINE, seed)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def pick(probs: torch.Tensor, uniforms) -> torch.Tensor:
    """Row r's token: the first column where the running sum of `probs[r]`
    passes `uniforms[r]` times the row's total (the inverse of the
    cumulative distribution; summed in float64, as torch.multinomial does).
    A column of probability 0 is never picked."""
    cumulative = probs.to(torch.float64).cumsum_(dim=-1)
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=probs.device)
    target = (u * cumulative[:, -1])[:, None]
    return torch.searchsorted(cumulative, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
