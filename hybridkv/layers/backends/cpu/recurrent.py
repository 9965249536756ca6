"""The cpu backend's recurrent ops: the reference's on gathered states,
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

from ..in_place import InPlaceGatedDelta, InPlaceSsd
from ..reference.recurrent import ReferenceGatedDelta, ReferenceMamba2, recurrent_ops as reference_ops


class CpuMamba2(InPlaceSsd, ReferenceMamba2):
    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    def kernel(self, state: torch.Tensor, rows: torch.Tensor, x, dt, A, B, C, D, lengths) -> torch.Tensor:
        """kernels.c ssd (in_place.InPlaceSsd)."""
        requests, length, heads, head_dim = x.shape
        groups, state_size = B.shape[-2:]
        x, dt, A, B, C, D = (t.float().contiguous() for t in (x, dt, A, B, C, D))
        rows, lengths = rows.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        y = torch.zeros(requests, length, heads, head_dim, dtype=torch.float32)  # (0 past a length)
        self.lib.ssd(x.data_ptr(), dt.data_ptr(), A.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(),
                     lengths.data_ptr(), requests, length, heads, head_dim, groups, state_size, state.data_ptr(),
                     rows.data_ptr(), state.stride(0), y.data_ptr(), torch.get_num_threads())
        return y


class CpuGatedDelta(InPlaceGatedDelta, ReferenceGatedDelta):
    name = "cpu"

    def __init__(self, lib):
        self.lib = lib

    def kernel(self, state: torch.Tensor, rows: torch.Tensor, q, k, v, g, beta, lengths) -> torch.Tensor:
        """kernels.c gated_delta (in_place.InPlaceGatedDelta)."""
        requests, length, key_heads, key_dim = q.shape
        value_heads, value_dim = v.shape[-2:]
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        rows, lengths = rows.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
        out = torch.zeros(requests, length, value_heads, value_dim, dtype=torch.float32)  # (0 past a length)
        if self.lib.gated_delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                lengths.data_ptr(), requests, length, key_heads, value_heads, key_dim, value_dim,
                                state.data_ptr(), rows.data_ptr(), state.stride(0), out.data_ptr(),
                                torch.get_num_threads()) != 0:
            raise ValueError(f"gated_delta: value heads of {value_dim} channels (the kernel takes up to 1,024)")
        return out


def recurrent_ops(lib) -> dict:
    """The cpu backend's ops for every recurrent kind: Mamba-1's and the
    short conv's are the reference's."""
    return {**reference_ops(), "mamba2": CpuMamba2(lib), "gated_delta": CpuGatedDelta(lib)}
