"""The shared modules the Triton backend runs its own way, swapped in by
`TritonBackend.prepare` (subclasses holding the same tensors, swap.py):

* `TritonRMSNorm`: the RMS norm, and the q/k norm followed by the rotary
  rotation (Gemma-3, Qwen3), in one kernel each (ops.norm_rotary), where
  torch's float32 norm takes five kernels (casts, the weight's offset, the
  norm, the cast back) and the rotation five more per tensor;
* `TritonGatedMLP`: the gated MLP's `act(gate) * up` in one kernel.

A decode step on a GPU is a chain of small kernels whose count, not their
bytes, sets its time: these two cut it by more than half on Gemma-3. Each
call checks its tensor (on the device the kernels run on, not being traced
by torch.compile) and otherwise runs the shared module's torch code.
"""

from __future__ import annotations

import torch
from torch import nn

from ...mlp import GatedMLP
from ...norm import RMSNorm
from ..swap import swap_norms_and_mlps as swap_for_twins


class TritonRMSNorm(RMSNorm):
    ops = None

    def _usable(self, x: torch.Tensor) -> bool:
        return ((x.is_cuda or self.ops.INTERPRETED) and x.stride(-1) == 1 and x.dim() in (2, 3)
                and not torch.compiler.is_compiling())

    def _run(self, x, cos=None, sin=None):
        return self.ops.norm_rotary(x, self.weight, 1.0 if self.unit_offset else 0.0, self.eps,
                                    round_before_scale=not (self.unit_offset or self.scale_in_float32),
                                    cos=cos, sin=sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x) if self._usable(x) else super().forward(x)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # Whole-head rotation only (a partial one, Bamba's, keeps torch's).
        if x.dim() == 3 and cos.shape[-1] == x.shape[-1] and self._usable(x) and cos.stride(-1) == 1 \
                and sin.stride(-1) == 1:
            return self._run(x, cos, sin)
        return super().rotated(x, cos, sin)


class TritonGatedMLP(GatedMLP):
    ops = None

    def activated(self, x):
        if x.dim() == 2 and (x.is_cuda or self.ops.INTERPRETED) and not torch.compiler.is_compiling():
            gate_up = self.gate_up_proj(x)
            if gate_up.stride(-1) == 1:
                return self.ops.gated_activation(gate_up, self.kind)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act(gate) * up
        return super().activated(x)


def swap_norms_and_mlps(model: nn.Module, ops) -> tuple[int, int]:
    """(norms, MLPs) swapped for their Triton twins (swap.py's rule)."""
    return swap_for_twins(model, TritonRMSNorm, TritonGatedMLP, ops.GATED_ACTIVATIONS, ops=ops)
