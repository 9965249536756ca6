"""The Mamba decode step through mamba-ssm's `selective_state_update` and
causal-conv1d's `causal_conv1d_update` (each optional; install mamba-ssm's
Triton kernels without its CUDA build: `MAMBA_SKIP_CUDA_BUILD=TRUE pip
install mamba-ssm`; causal-conv1d builds from source), for the "flashinfer"
backend.

Both kernels update a state tensor in place at batch indices. A Mamba state
here is one block of the pool, but a block may be made of pages that are
not one run (core/page_allocator.py: a wide block can be put together from
pieces), so no single strided tensor reaches every state in place. The
states are gathered first, as the reference does (backends/reference),
and the kernels update the gathered rows in place (`state_batch_indices`),
which `finish` writes back: one read and one write of each state more than
hybridkv's own Triton kernels, which follow the pages.

The argument conversion is what runs here: the tests check it on the CPU
with the kernels' documented semantics written in torch (`emulated_kernels`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...recurrent_state import MambaMetadata
from ..reference.recurrent import ReferenceMamba
from ..reference.recurrent import recurrent_ops as reference_ops


def load_kernels():
    """(selective_state_update, causal_conv1d_update or None), or None when
    mamba-ssm is not installed."""
    try:
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except ImportError:
        selective_state_update = _triton_kernel_alone()
        if selective_state_update is None:
            return None
    try:
        from causal_conv1d import causal_conv1d_update
    except ImportError:
        causal_conv1d_update = None
    return selective_state_update, causal_conv1d_update


def _triton_kernel_alone():
    """mamba-ssm installed without its CUDA build (MAMBA_SKIP_CUDA_BUILD)
    cannot import its package: the package's __init__ imports the CUDA
    extension. Its Triton kernel needs none of that, so it is loaded from
    its file, under bare package modules in place of the package's own
    (made only when `mamba_ssm` is not imported already)."""
    import importlib
    import importlib.util
    import sys
    import types

    spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = spec.submodule_search_locations[0]
    for name, path in (("mamba_ssm", root), ("mamba_ssm.ops", f"{root}/ops"),
                       ("mamba_ssm.ops.triton", f"{root}/ops/triton")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    try:
        return importlib.import_module("mamba_ssm.ops.triton.selective_state_update").selective_state_update
    except ImportError:
        return None


class MambaSsmMamba(ReferenceMamba):
    """Mamba-1's ops: gathered states (the reference's build and finish),
    the decode ops by mamba-ssm / causal-conv1d where present (the
    reference where not)."""

    name = "mamba-ssm"

    def __init__(self, selective_state_update, causal_conv1d_update=None):
        self.selective_state_update = selective_state_update
        self.causal_conv1d_update = causal_conv1d_update
        self._zero_bias = None

    def _zeros(self, dt: torch.Tensor) -> torch.Tensor:
        zeros = self._zero_bias
        if zeros is None or zeros.shape[0] != dt.shape[-1] or zeros.device != dt.device:
            zeros = self._zero_bias = torch.zeros(dt.shape[-1], dtype=torch.float32, device=dt.device)
        return zeros

    def conv_step(self, meta: MambaMetadata, layer_name: str, x, weight, bias) -> torch.Tensor:
        if self.causal_conv1d_update is None:
            return super().conv_step(meta, layer_name, x, weight, bias)
        conv_state = meta.state_views(layer_name)[0]  # [R, channels, width - 1]: causal-conv1d's layout
        return self.causal_conv1d_update(x, conv_state, weight, bias, activation="silu",
                                         conv_state_indices=meta.step_rows.to(torch.int32))

    def step(self, meta: MambaMetadata, layer_name: str, x, dt, A, B, C, D, gate) -> torch.Tensor:
        ssm_state = meta.state_views(layer_name)[1]  # [R, channels, state size]
        # dt arrives after softplus (the layer adds its bias first), so the bias
        # is zero and no softplus here; mamba-ssm 2.3.2 reads dt_bias's strides
        # unconditionally (a None fails), hence the zeros rather than None.
        y = self.selective_state_update(ssm_state, x, dt, A, B, C, D=D, z=gate, dt_bias=self._zeros(dt),
                                        dt_softplus=False, state_batch_indices=meta.step_rows.to(torch.int32))
        return y.float()


def recurrent_ops(selective_state_update, causal_conv1d_update=None) -> dict:
    """mamba-ssm's ops for Mamba-1 (`MambaSsmMamba`); every other kind's
    are the reference's."""
    return {**reference_ops(), "mamba": MambaSsmMamba(selective_state_update, causal_conv1d_update)}


def emulated_kernels():
    """The two kernels' documented semantics in torch (for the CPU tests):
    in place on `state[indices]`, returning the step's output."""

    def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                               state_batch_indices=None):
        if dt_bias is None:  # as mamba-ssm 2.3.2 fails: it reads dt_bias's strides whatever it is
            raise TypeError("selective_state_update needs a dt_bias tensor")
        rows = state_batch_indices.long()
        dt = dt + dt_bias
        if dt_softplus:
            dt = F.softplus(dt)
        h = state[rows].float()
        h = h * torch.exp(dt.float().unsqueeze(-1) * A.float()) + \
            (dt.float() * x.float()).unsqueeze(-1) * B.float().unsqueeze(1)
        state[rows] = h.to(state.dtype)
        out = (h * C.float().unsqueeze(1)).sum(-1)
        if D is not None:
            out = out + x.float() * D.float()
        if z is not None:
            out = out * F.silu(z.float())
        return out.to(x.dtype)

    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
        rows = conv_state_indices.long()
        window = torch.cat([conv_state[rows].to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [R, channels, width]
        conv_state[rows] = window[:, :, 1:].to(conv_state.dtype)
        out = (window * weight.unsqueeze(0)).sum(-1)
        if bias is not None:
            out = out + bias
        return F.silu(out) if activation in ("silu", "swish") else out

    return selective_state_update, causal_conv1d_update
