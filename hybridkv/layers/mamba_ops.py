"""Mamba (selective state space) ops with a carried state, torch reference.

Shapes: `I` channels (d_inner), `N` state size, `K` conv width. A request's
state is `conv [I, K-1]` (the K-1 inputs before the next token, oldest
first) and `ssm [I, N]` (float32). Prefill chunks continue from the stored
state, so a prompt can be split anywhere (a Mamba checkpoint, a token
budget) and give the same result as one pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one request's chunk. x: [L, I]; conv_state:
    [I, K-1]; weight: [I, K]. Returns (y [L, I], new conv state [I, K-1])."""
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [I, K-1+L]
    y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=weight.shape[0])[0]
    width = conv_state.shape[1]
    new_state = window[:, window.shape[1] - width:] if width else conv_state
    return y.t(), new_state


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R requests. x: [R, I]; conv_state: [R, I, K-1]."""
    window = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [R, I, K]
    y = (window * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    return y, window[:, :, 1:]


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = C_t . h_t with h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, from h_0 = state.
    x, dt: [L, I] (dt after softplus); A: [I, N]; B, C: [L, N]; state: [I, N] float32.
    Returns (y [L, I] float32, final state [I, N] float32)."""
    dt = dt.float()
    dA = torch.exp(dt.unsqueeze(-1) * A.float().unsqueeze(0))  # [L, I, N]
    dBx = (dt * x.float()).unsqueeze(-1) * B.float().unsqueeze(1)  # [L, I, N]
    C = C.float()
    h = state.float()
    ys = []
    for t in range(x.shape[0]):
        h = dA[t] * h + dBx[t]
        ys.append(h @ C[t])
    return torch.stack(ys), h


def selective_scan_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of R requests. x, dt: [R, I]; B, C: [R, N];
    state: [R, I, N]. Returns (y [R, I] float32, new state)."""
    dt = dt.float()
    h = torch.exp(dt.unsqueeze(-1) * A.float()) * state.float() + (dt * x.float()).unsqueeze(-1) * B.float().unsqueeze(1)
    y = (h * C.float().unsqueeze(1)).sum(-1)
    return y, h
