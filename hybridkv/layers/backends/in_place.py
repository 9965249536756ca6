"""Mamba-2's update and the gated delta rule stepped by an implementation's
kernel on the gathered float32 states in place, decode rows and prefill
chunks alike (the C and Triton implementations put these before the
reference's class of the kind). A subclass gives `kernel(state, rows,
...inputs, lengths)` over [R, L, ...] inputs from state rows `rows` of
`state` (each row contiguous), returning float32 outputs, 0 past a length.
bfloat16 states, and chunks that keep every token's state (verified
drafts), go to the next class in line (the reference's ops)."""

from __future__ import annotations

import torch


def in_place(state: torch.Tensor) -> bool:
    """Whether a kernel can step the gathered rows of `state` where they are."""
    return state.dtype == torch.float32 and state[0].is_contiguous()


def one_token(rows: torch.Tensor) -> torch.Tensor:
    return torch.ones(rows.shape[0], dtype=torch.int64, device=rows.device)


class InPlaceSsd:
    """Mamba-2's `step` and `prefill` (Mamba2Ops) through `kernel(state,
    rows, x, dt, A, B, C, D, lengths)`."""

    def step(self, meta, layer_name, x, dt, A, B, C, D):
        state = meta.state_views(layer_name)[1]
        if not in_place(state):
            return super().step(meta, layer_name, x, dt, A, B, C, D)
        return self.kernel(state, meta.step_rows, x[:, None], dt[:, None], A, B[:, None], C[:, None], D,
                           one_token(x))[:, 0]

    def prefill(self, meta, layer_name, rows, x, dt, A, B, C, D, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not in_place(state):
            return super().prefill(meta, layer_name, rows, x, dt, A, B, C, D, lengths, keep)
        return self.kernel(state, rows, x, dt, A, B, C, D, lengths)


class InPlaceGatedDelta:
    """Gated DeltaNet's `step` and `prefill` (GatedDeltaOps) through
    `kernel(state, rows, q, k, v, g, beta, lengths)`."""

    def step(self, meta, layer_name, q, k, v, g, beta):
        state = meta.state_views(layer_name)[1]
        if not in_place(state):
            return super().step(meta, layer_name, q, k, v, g, beta)
        return self.kernel(state, meta.step_rows, q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                           one_token(q))[:, 0]

    def prefill(self, meta, layer_name, rows, q, k, v, g, beta, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not in_place(state):
            return super().prefill(meta, layer_name, rows, q, k, v, g, beta, lengths, keep)
        return self.kernel(state, rows, q, k, v, g, beta, lengths)
