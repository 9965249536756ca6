"""Mamba (selective state space) ops with a carried state, torch reference.

Shapes: `I` channels (d_inner), `N` state size, `K` conv width. A request's
state is `conv [I, K-1]` (the K-1 inputs before the next token, oldest
first) and `ssm [I, N]` (float32). Prefill chunks continue from the stored
state, so a prompt can be split anywhere (a Mamba checkpoint, a token
budget) and give the same result as one pass. The prefill ops take all of a
step's prefill chunks at once, padded to the longest: the scan is a loop
over tokens, so running the requests side by side divides its Python
overhead by their number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, lengths: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of R requests' chunks at once. x: [R, L, I],
    request r's tokens in x[r, :lengths[r]] (the rest is padding, which only
    affects outputs at padded positions); conv_state: [R, I, K-1]; weight:
    [I, K]. Returns (y [R, L, I], new conv states [R, I, K-1]: the K-1 inputs
    before each request's next token)."""
    window = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [R, I, K-1+L]
    y = F.conv1d(window, weight.unsqueeze(1), bias, groups=weight.shape[0])
    width = conv_state.shape[2]
    if not width:
        return y.transpose(1, 2), conv_state
    index = (lengths[:, None] + torch.arange(width, device=x.device)[None, :])[:, None, :]
    new_state = window.gather(2, index.expand(-1, window.shape[1], -1))
    return y.transpose(1, 2), new_state


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R requests. x: [R, I]; conv_state: [R, I, K-1]."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [R, I, K]
    y = (window * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    return y, window[:, :, 1:]


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor, lengths: torch.Tensor, per_token: bool = False):
    """y_t = C_t . h_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, from h_0 = state,
    for R requests side by side. x, dt: [R, L, I] (dt after softplus); A: [I, N];
    B, C: [R, L, N]; state: [R, I, N]; request r's tokens are the first
    lengths[r], lengths in descending order. Returns (y [R, L, I] float32,
    final states [R, I, N] float32, and with `per_token` the state after each
    token [R, L, I, N] (else None); y is 0 past a request's length).

    Past a request's length dt is set to 0, so exp(0 * A) = 1 and the input
    term vanishes: its state passes through the padding unchanged. Tokens go
    a few at a time (bounded memory); within such a slice only the requests
    still running take part (they are the first rows, by the order), and each
    token costs one fused multiply-add over them."""
    requests, length, channels = x.shape
    valid = torch.arange(length, device=x.device)[None, :] < lengths[:, None]
    dt = dt.float() * valid.unsqueeze(-1)
    A, B, C = A.float(), B.float(), C.float()
    h = state.float().clone()
    y = torch.zeros(requests, length, channels, dtype=torch.float32, device=x.device)
    every = torch.zeros(requests, length, *h.shape[1:], dtype=torch.float32, device=x.device) if per_token else None
    running = lengths.tolist()
    step = max(1, (1 << 20) // max(1, requests * channels * A.shape[1]))  # ~4 MB per slice: stays in cache
    for t0 in range(0, length, step):
        t1 = min(length, t0 + step)
        k = sum(1 for n in running if n > t0)  # requests with tokens in this slice
        d = dt[:k, t0:t1].unsqueeze(-1)
        dA = torch.exp(d * A)  # [k, T, I, N]
        states = (d * x[:k, t0:t1].float().unsqueeze(-1)) * B[:k, t0:t1].unsqueeze(2)  # dt B x, then h in place
        hk = h[:k]
        for decay, state_j in zip(dA.unbind(1), states.unbind(1)):
            hk = torch.addcmul(state_j, decay, hk, out=state_j)
        h[:k] = hk
        if per_token:  # `states` now holds h after each token of the slice
            every[:k, t0:t1] = states
        y[:k, t0:t1] = torch.einsum("rtin,rtn->rti", states, C[:k, t0:t1])
    return y, h, every


def selective_scan_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R requests. x, dt: [R, I]; B, C: [R, N];
    state: [R, I, N]. Returns (y [R, I] float32, new state)."""
    dt = dt.float()
    h = torch.exp(dt.unsqueeze(-1) * A.float()) * state.float() + (dt * x.float()).unsqueeze(-1) * B.float().unsqueeze(1)
    y = (h * C.float().unsqueeze(1)).sum(-1)
    return y, h
