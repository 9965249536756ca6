"""The gated delta rule (Gated DeltaNet: Yang, Kautz and Hatamizadeh,
"Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025) with a
carried state, torch reference.

Per value head the state is a matrix `S [K, V]` that maps keys to values.
A token brings a query q and a key k (L2-normalised, q also scaled by
K ** -0.5), a value v, a log decay g <= 0 and a write strength beta in
(0, 1). The state first decays, then the value it predicts for k is
moved towards v (the delta rule), then the query reads it:

    S' = exp(g) S_{t-1}        u = beta (v - S'^T k)        S_t = S' + k u^T        o = S_t^T q

Query and key heads may be fewer than value heads (Hk divides Hv): key
head j serves value heads j * Hv / Hk .. (j + 1) * Hv / Hk - 1.

Decode runs that recurrence one token (`gated_delta_step`). Prefill runs
the chunked form (`gated_delta_scan`, the paper's section 3.3 with the
WY / UT representation of DeltaNet): in a chunk of Q tokens with decays
`G[t, s] = exp(g_{s+1} + ... + g_t)` (from the chunk's start: `G0[t]`), the
u of every token solve one unit lower-triangular system,

    u_t + beta_t sum_{s<t} G[t, s] (k_t . k_s) u_s = beta_t v_t - beta_t G0[t] S_0^T k_t,

then `o_t = G0[t] S_0^T q_t + sum_{s<=t} G[t, s] (q_t . k_s) u_s` and the
state at the chunk's end is `G0[Q] S_0 + sum_s G[Q, s] k_s u_s^T`; across
chunks only that state is carried. Both forms continue from the stored
state, so a prompt can be split anywhere and give the result of one pass.

Shapes, R requests side by side (padded to the longest, as the other
scans take them): q, k [R, L, Hk, K], v [R, L, Hv, V], g and beta
[R, L, Hv], state [R, Hv, K, V] (float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


CHUNK = 64  # tokens per chunk of the prefill scan


def _per_value_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., Hk, K] -> [..., Hv, K]: each value head reads its key head."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def gated_delta_step(q, k, v, g, beta, state):
    """One token for each of R requests: q, k [R, Hk, K], v [R, Hv, V], g
    and beta [R, Hv], state [R, Hv, K, V]. Returns (o [R, Hv, V] float32,
    new state)."""
    heads = v.shape[1]
    q, k = _per_value_head(q.float(), heads), _per_value_head(k.float(), heads)
    decayed = torch.exp(g.float())[..., None, None] * state.float()
    u = beta.float()[..., None] * (v.float() - torch.einsum("rhkv,rhk->rhv", decayed, k))
    s = decayed + k[..., None] * u[..., None, :]
    return torch.einsum("rhkv,rhk->rhv", s, q), s


def chunk_decays(g: torch.Tensor) -> torch.Tensor:
    """g [..., Q] (a chunk's log decays) -> G [..., Q(t), Q(s)] = exp(g_{s+1} + ...
    + g_t) for s <= t, 0 above the diagonal: ssd_ops.segment_sums's masked
    cumulative sum (the terms summed, not a difference of running sums), laid
    out with the tokens last, as the products and the solve read it."""
    q = g.shape[-1]
    on_or_below = torch.ones(q, q, dtype=torch.bool, device=g.device).tril()
    sums = torch.where(on_or_below.tril(-1), g[..., :, None], 0.0).cumsum(-2)  # [t, s]: the sum over (s, t]
    return torch.exp(sums) * on_or_below


def gated_delta_scan(q, k, v, g, beta, state, lengths, per_token: bool = False, chunk: int = CHUNK):
    """R requests' chunks from their states (module docstring for shapes).
    Returns (o [R, L, Hv, V] float32, final states [R, Hv, K, V] float32,
    and with `per_token` the state after each token [R, L, Hv, K, V], else
    None).

    Past a request's length g and beta are 0: no decay and no write, so its
    state passes through the padding unchanged. With `per_token` (the few
    tokens of a verified draft chunk) the recurrence runs token by token,
    which yields every state on the way; otherwise chunked."""
    requests, length, heads = g.shape
    valid = (torch.arange(length, device=g.device)[None, :] < lengths[:, None])[..., None]
    g, beta = g.float() * valid, beta.float() * valid
    q, k, v = _per_value_head(q.float(), heads), _per_value_head(k.float(), heads), v.float()
    if per_token:
        s = state.float()
        o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        every = torch.empty(requests, length, *s.shape[1:], dtype=torch.float32, device=v.device)
        for t in range(length):
            o[:, t], s = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
            every[:, t] = s
        return o, s, every
    chunk = min(chunk, length)  # (a step's short chunks are not padded to a whole one)
    pad = -length % chunk
    if pad:
        q, k, v, g, beta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, g, beta))
    n = q.shape[1] // chunk
    # [R, chunks, heads, Q, ...]: the heads before the tokens, for the batched products and solves.
    q, k, v = (t.view(requests, n, chunk, heads, -1).transpose(2, 3) for t in (q, k, v))
    g, beta = (t.view(requests, n, chunk, heads).transpose(2, 3) for t in (g, beta))
    decays = chunk_decays(g)  # [R, n, H, Q(t), Q(s)]: G[t, s]
    from_start = torch.exp(g.cumsum(-1))  # [R, n, H, Q]: G0[t]
    # The unit lower-triangular system of each chunk: the solve reads only below the diagonal
    # (decays is 0 above it), the 1s on it are implied. One solve for both right-hand sides:
    # the part of u from the chunk's own values, and what times S_0 gives the part from the
    # carried state.
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * decays
    both = torch.linalg.solve_triangular(system, torch.cat([beta[..., None] * v, (beta * from_start)[..., None] * k],
                                                           -1), upper=False, unitriangular=True)
    u_inputs, u_state = both.split([v.shape[-1], k.shape[-1]], -1)
    reads = (q @ k.transpose(-1, -2)) * decays  # G[t, s] (q_t . k_s), s <= t (decays is 0 above)
    to_end = decays[..., -1, :, None] * k  # G[Q, s] k_s
    s = state.float()
    o = torch.empty(requests, n, heads, chunk, v.shape[-1], dtype=torch.float32, device=v.device)
    for c in range(n):
        u = u_inputs[:, c] - u_state[:, c] @ s
        o[:, c] = from_start[:, c, ..., None] * (q[:, c] @ s) + reads[:, c] @ u
        s = from_start[:, c, :, -1, None, None] * s + to_end[:, c].transpose(-1, -2) @ u
    o = o.transpose(2, 3).reshape(requests, n * chunk, heads, -1)[:, :length]
    return o, s, None
