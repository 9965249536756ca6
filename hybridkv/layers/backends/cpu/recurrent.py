"""The cpu backend's recurrent side: the reference's ops on gathered states,
with Mamba-2's state update (SSD: Nemotron-H, Granite-4.0-H, Bamba,
Falcon-H1; kernels.c `ssd`) and the gated delta rule (Gated DeltaNet:
Qwen3-Next, Qwen3.5; `gated_delta`) in C: decode steps and prefill chunks
run the recurrence token by token on the states where the gathered rows
hold them, in place, where the reference makes a copy of the rows and runs
the chunked form in torch (masked cumulative sums, a triangular solve and
batched products a chunk, which at these heads' sizes cost more than the
recurrence's own few flops per state element a token). Being sequential,
a chunk cut at a checkpoint leaves the state a chunk ending there leaves,
to the bit.

The C paths take float32 states (the default `recurrent_state_dtype`);
bfloat16 states, and chunks that keep every token's state (verified
drafts), run the reference's ops, as do Mamba-1 and the short conv.
"""

from __future__ import annotations

import torch

from ...recurrent_state import MambaMetadata
from ..reference.recurrent import ReferenceRecurrent


class CpuRecurrent(ReferenceRecurrent):
    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    def _delta(self, state: torch.Tensor, rows: torch.Tensor, q, k, v, g, beta, lengths) -> torch.Tensor:
        """kernels.c gated_delta over [R, L, ...] inputs from state rows
        `rows` of `state` [*, Hv, K, V] (float32, each row contiguous)."""
        requests, length, key_heads, key_dim = q.shape
        value_heads, value_dim = v.shape[-2:]
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        rows = rows.to(torch.int64).contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.zeros(requests, length, value_heads, value_dim, dtype=torch.float32)  # (0 past a length)
        if self.lib.gated_delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                lengths.data_ptr(), requests, length, key_heads, value_heads, key_dim, value_dim,
                                state.data_ptr(), rows.data_ptr(), state.stride(0), out.data_ptr(),
                                torch.get_num_threads()) != 0:
            raise ValueError(f"gated_delta: value heads of {value_dim} channels (the kernel takes up to 1,024)")
        return out

    @staticmethod
    def _runs_in_c(state: torch.Tensor) -> bool:
        return state.dtype == torch.float32 and state.device.type == "cpu" and state[0].is_contiguous()

    def _ssd(self, state: torch.Tensor, rows: torch.Tensor, x, dt, A, B, C, D, lengths) -> torch.Tensor:
        """kernels.c ssd over [R, L, ...] inputs from state rows `rows` of
        `state` [*, H, P, N] (float32, each row contiguous)."""
        requests, length, heads, head_dim = x.shape
        groups, state_size = B.shape[-2:]
        x, dt, A, B, C, D = (t.float().contiguous() for t in (x, dt, A, B, C, D))
        rows, lengths = rows.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        y = torch.zeros(requests, length, heads, head_dim, dtype=torch.float32)  # (0 past a length)
        self.lib.ssd(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                     lengths.data_ptr(), requests, length, heads, head_dim, groups, state_size, state.data_ptr(),
                     rows.data_ptr(), state.stride(0), y.data_ptr(), torch.get_num_threads())
        return y

    def ssd_step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D):
        state = meta.state_views(layer_name)[1]
        if not self._runs_in_c(state):
            return super().ssd_step(meta, layer_name, x, dt, A, B, C, D)
        ones = torch.ones(x.shape[0], dtype=torch.int64)
        return self._ssd(state, meta.step_rows, x[:, None], dt[:, None], A, B[:, None], C[:, None], D, ones)[:, 0]

    def ssd_prefill(self, meta: MambaMetadata, layer_name: str, rows, x, dt, A, B, C, D, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not self._runs_in_c(state):
            return super().ssd_prefill(meta, layer_name, rows, x, dt, A, B, C, D, lengths, keep)
        return self._ssd(state, rows, x, dt, A, B, C, D, lengths)

    def gated_delta_step(self, meta: MambaMetadata, layer_name: str, q, k, v, g, beta):
        state = meta.state_views(layer_name)[1]
        if not self._runs_in_c(state):
            return super().gated_delta_step(meta, layer_name, q, k, v, g, beta)
        ones = torch.ones(q.shape[0], dtype=torch.int64)
        out = self._delta(state, meta.step_rows, q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], ones)
        return out[:, 0]

    def gated_delta_prefill(self, meta: MambaMetadata, layer_name: str, rows, q, k, v, g, beta, lengths, keep=False):
        state = meta.state_views(layer_name)[1]
        if keep or not self._runs_in_c(state):
            return super().gated_delta_prefill(meta, layer_name, rows, q, k, v, g, beta, lengths, keep)
        return self._delta(state, rows, q, k, v, g, beta, lengths)
