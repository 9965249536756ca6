"""Mamba-2's state update (SSD, state-space duality) with a carried state,
torch reference.

Per head h the state is a matrix `S [P, N]` (P head channels, N state
size) and the decay is one scalar per token, `exp(dt_t A_h)`:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D_h x_t

B and C are shared by the heads of a group (G groups, H / G heads each).
Decode runs that recurrence one token (`ssd_step`). Prefill runs the
paper's chunked form (`ssd_scan`): within a chunk of Q tokens the outputs
are a masked, decayed attention-like product `(C_t . B_u) L[t, u] dt_u x_u`
with `L[t, u] = exp(sum_{u < s <= t} dt_s A)`; across chunks only the
states at chunk ends are carried, one small recurrence per chunk. Both
continue from the stored state, so a prompt can be split anywhere and
give the result of one pass.

Shapes, R requests side by side (padded to the longest, lengths in
descending order, as the Mamba-1 scan takes them): x [R, L, H, P], dt
[R, L, H] (after softplus and the config's clamp), A [H] (negative), B and
C [R, L, G, N], D [H], state [R, H, P, N] (float32).
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk of the prefill scan (the products are Q x Q per head)


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each head reads its group's B or C."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def ssd_step(x, dt, A, B, C, D, state):
    """One token for each of R requests: x [R, H, P], dt [R, H], B and C
    [R, G, N], state [R, H, P, N]. Returns (y [R, H, P] float32, new state)."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    decay = torch.exp(dt * A.float())  # [R, H]
    inputs = (dt[..., None] * x)[..., None] * _per_head(B.float(), heads)[:, :, None, :]
    h = decay[..., None, None] * state.float() + inputs
    y = torch.einsum("rhpn,rhn->rhp", h, _per_head(C.float(), heads)) + D.float()[:, None] * x
    return y, h


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q, H] (per-token log decays) -> [..., Q(t), Q(u), H]: the sum
    of a over (u, t] where u <= t, -inf above the diagonal. Summed from the
    terms themselves (a masked cumulative sum), not as a difference of two
    running sums, which loses precision once the sums are large."""
    q = a.shape[-2]
    terms = a.unsqueeze(-2).expand(*a.shape[:-2], q, q, a.shape[-1])  # [t, u] = a_t
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)[:, :, None]
    sums = terms.masked_fill(~below, 0.0).cumsum(-3)
    keep = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()[:, :, None]
    return sums.masked_fill(~keep, float("-inf"))


def ssd_scan(x, dt, A, B, C, D, state, lengths, per_token: bool = False, chunk: int = CHUNK):
    """R requests' chunks from their states (module docstring for shapes).
    Returns (y [R, L, H, P] float32, final states [R, H, P, N] float32, and
    with `per_token` the state after each token [R, L, H, P, N], else None).

    Past a request's length dt is 0: the decay is 1 and the input term 0,
    so its state passes through the padding unchanged. With `per_token`
    (the few tokens of a verified draft chunk) the recurrence runs token by
    token, which yields every state on the way; otherwise chunked."""
    requests, length, heads, channels = x.shape
    valid = torch.arange(length, device=x.device)[None, :] < lengths[:, None]
    dt = dt.float() * valid[..., None]
    x, A, D = x.float(), A.float(), D.float()
    if per_token:
        h = state.float()
        y = torch.empty(requests, length, heads, channels, dtype=torch.float32, device=x.device)
        every = torch.empty(requests, length, *h.shape[1:], dtype=torch.float32, device=x.device)
        for t in range(length):
            y[:, t], h = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], D, h)
            every[:, t] = h
        return y, h, every
    pad = -length % chunk
    if pad:
        x, dt, B, C = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n = x.shape[1] // chunk
    # [R, chunks, Q, ...]
    x, dt = x.view(requests, n, chunk, heads, channels), dt.view(requests, n, chunk, heads)
    B = _per_head(B.float(), heads).view(requests, n, chunk, heads, -1)
    C = _per_head(C.float(), heads).view(requests, n, chunk, heads, -1)
    a = dt * A  # log decay of each token, <= 0
    within = _segment_sums(a)  # [R, n, Q(t), Q(u), H]
    xdt = x * dt[..., None]
    # Inside a chunk: y_t = sum_{u <= t} (C_t . B_u) L[t, u] dt_u x_u.
    scores = torch.einsum("rcthn,rcuhn->rctuh", C, B) * torch.exp(within)
    y = torch.einsum("rctuh,rcuhp->rcthp", scores, xdt)
    # What each chunk adds to the state by its end: sum_u L[end, u] dt_u x_u B_u^T.
    to_end = torch.exp(within[:, :, -1])  # [R, n, Q(u), H]
    added = torch.einsum("rcuh,rcuhp,rcuhn->rchpn", to_end, xdt, B)
    # Across chunks: the state at each chunk's start, one step per chunk.
    total = torch.exp(a.sum(2))  # [R, n, H]: a chunk's whole decay
    h = state.float()
    starts = []
    for c in range(n):
        starts.append(h)
        h = total[:, c, :, None, None] * h + added[:, c]
    starts = torch.stack(starts, 1)  # [R, n, H, P, N]
    # From the chunk's start state: y_t += exp(sum_{s <= t} a_s) C_t . S_start.
    since_start = torch.exp(a.cumsum(2))  # [R, n, Q, H]
    y = y + torch.einsum("rcthn,rchpn->rcthp", C, starts) * since_start[..., None]
    y = y.reshape(requests, n * chunk, heads, channels)[:, :length] + D[:, None] * x.reshape(
        requests, n * chunk, heads, channels)[:, :length]
    return y, h, None
