"""The Mamba-2 mixer the Mamba-2 hybrids share (Nemotron-H, Granite-4.0-H,
Bamba, Falcon-H1), with Hugging Face parameter names.

in_proj -> (z, xBC, dt), one product; a depthwise causal conv over xBC
(x, B and C, from the carried conv window), SiLU; dt = softplus(dt +
dt_bias), clamped to the config's limits; the SSD update per head from the
carried state (A = -exp(A_log), one scalar per head; B and C shared by the
heads of a group; + D x); then the gate: by default a gated RMS norm over
groups of channels, `norm(y * silu(z))` (Falcon-H1 can instead normalise
before gating, or skip the norm: `y * silu(z)`); out_proj. The state ops
are the backend's for Mamba-2 (`Mamba2Ops`: `conv_step` / `conv_prefill`,
`step` / `prefill`; backends/base.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.parallel import ColumnParallelLinear, RowParallelLinear, current_ranks, leading_part
from ..layers.recurrent_state import padded_chunks
from ..layers.step import StepBatch
from .base import CacheLayer


def _shift(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


class GatedGroupRMSNorm(nn.Module):
    """RMS norm of y over `groups` equal groups of channels, with the SiLU
    gate applied before it (`gate_first`, Mamba-2's default) or after it.
    In float32; the weight scales the normalised values.

    `shared_group=(group, groups)`: under tensor parallelism with fewer
    groups than ranks, y is this rank's part of group `group` of `groups`
    whose other parts the other ranks hold: the sum of squares is summed
    over the ranks (one all-reduce of [tokens, groups]) and divided by the
    whole group's width, `size` x the ranks sharing it."""

    def __init__(self, size: int, groups: int, eps: float, gate_first: bool = True,
                 shared_group: tuple[int, int] | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps, self.gate_first = groups, eps, gate_first
        self.shared_group = shared_group
        self.ranks = current_ranks()

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = y.float()
        silu = F.silu(gate.float())
        if self.gate_first:
            y = y * silu
        if self.shared_group is not None:
            group, groups = self.shared_group
            squares = y.new_zeros(*y.shape[:-1], groups)
            squares[..., group] = (y * y).sum(-1)
            width = y.shape[-1] * self.ranks.world // groups
            y = y * torch.rsqrt(self.ranks.all_reduce(squares)[..., group, None] / width + self.eps)
            y = y * self.weight.float()
        else:
            shape = y.shape
            grouped = y.reshape(*shape[:-1], self.groups, -1)
            y = F.rms_norm(grouped, grouped.shape[-1:], None, self.eps).reshape(shape) * self.weight.float()
        return y if self.gate_first else y * silu


class Mamba2Mixer(CacheLayer, nn.Module):
    """A Mamba-2 layer over the paged recurrent state (module docstring).

    `norm`: "gated" (norm(y * silu(z))), "gated_after" (norm(y) * silu(z))
    or None (y * silu(z)); `dt_limit`: the clamp of dt after softplus;
    `in_scale`: a fixed per-channel scale of in_proj's output (Falcon-H1's
    multipliers), or None."""

    def __init__(self, hidden: int, heads: int, head_dim: int, groups: int, state: int, conv_width: int, *,
                 conv_bias: bool, in_bias: bool, out_bias: bool, eps: float, dt_limit=(0.0, float("inf")),
                 norm: str | None = "gated", in_scale: torch.Tensor | None = None, activation: str = "silu"):
        nn.Module.__init__(self)
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-2 layers with activation {activation!r} are not supported (SiLU only)")
        # Tensor parallelism (layers/parallel.py): a rank holds its share of
        # the heads (their x, z, dt rows of in_proj, conv channels, A, D,
        # dt_bias, norm weight, out_proj columns) and the groups its heads
        # read (whole groups when there are at least as many as ranks, else
        # the one group, which its neighbours hold too), so its conv and SSM
        # states are its heads'. The sizes were checked (modeling/tensor_split.py).
        self.ranks = ranks = current_ranks()
        local_heads, local_groups = heads // ranks.world, max(1, groups // ranks.world)
        first_head = ranks.rank * local_heads
        first_group = ranks.rank * local_groups if groups >= ranks.world else first_head // (heads // groups)
        inner, bc = heads * head_dim, groups * state
        x_rows = slice(first_head * head_dim, (first_head + local_heads) * head_dim)
        bc_rows = slice(first_group * state, (first_group + local_groups) * state)
        self.head_rows = slice(first_head, first_head + local_heads)
        self.x_rows = x_rows
        # the rank's conv channels (x, B, C) and in_proj rows (z, x, B, C, dt), each as parts of the whole
        self.conv_rows = [x_rows, _shift(bc_rows, inner), _shift(bc_rows, inner + bc)]
        in_rows = [x_rows, *(_shift(r, inner) for r in self.conv_rows), _shift(self.head_rows, 2 * inner + 2 * bc)]
        self.heads, self.head_dim, self.groups, self.state = local_heads, head_dim, local_groups, state
        self.inner = local_heads * head_dim
        self.conv_dim = self.inner + 2 * local_groups * state
        self.in_proj = ColumnParallelLinear(hidden, 2 * inner + 2 * bc + heads, bias=in_bias, rows=in_rows)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_width, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(local_heads))
        self.A_log = nn.Parameter(torch.zeros(local_heads))
        self.D = nn.Parameter(torch.ones(local_heads))
        if norm is not None:
            shared = (first_group, groups) if groups < ranks.world else None
            self.norm = GatedGroupRMSNorm(self.inner, local_groups, eps, gate_first=norm == "gated",
                                          shared_group=shared)
        else:
            self.norm = None
        self.out_proj = RowParallelLinear(inner, hidden, bias=out_bias)
        self.dt_limit = tuple(float(v) for v in dt_limit)
        # A plain tensor, not a buffer: the model is built on the meta
        # device and loads parameters only; it moves on first use.
        self.in_scale = None if in_scale is None else torch.cat([in_scale[r] for r in in_rows]).to("cpu")

    def checkpoint_part(self, name: str, ndim: int):
        """The rank's heads' or channels' part of the parameters indexed by
        them (the projections answer for themselves)."""
        if self.ranks.world == 1:
            return None
        if name in ("dt_bias", "A_log", "D"):
            return leading_part(self.head_rows, ndim)
        if name in ("conv1d.weight", "conv1d.bias"):
            return leading_part(self.conv_rows, ndim)
        if name == "norm.weight":
            return (self.x_rows,)
        return None

    def _dt(self, raw: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(raw.float() + self.dt_bias.float())
        low, high = self.dt_limit
        return dt.clamp(min=low, max=high) if (low, high) != (0.0, float("inf")) else dt

    def _split(self, xbc: torch.Tensor):
        return xbc.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)

    def forward(self, h: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        meta = batch.recurrent[self.group]
        ops, name = self.ops, self.layer_name
        projected = self.in_proj(h)
        if self.in_scale is not None:
            if self.in_scale.device != projected.device or self.in_scale.dtype != projected.dtype:
                # moved once, not every step; in the weights' dtype, as a buffer of transformers' is
                self.in_scale = self.in_scale.to(projected.device, projected.dtype)
            projected = projected * self.in_scale
        z, xbc_all, dt_all = projected.split([self.inner, self.conv_dim, self.heads], dim=-1)
        weight, bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        heads, dim, groups, state = self.heads, self.head_dim, self.groups, self.state
        y_all = torch.empty(h.shape[0], self.inner, dtype=torch.float32, device=h.device)
        if meta.num_steps:  # one token for each of these sequences
            t = meta.step_tokens
            x, B, C = self._split(ops.conv_step(meta, name, xbc_all[t], weight, bias))
            y = ops.step(meta, name, x.reshape(-1, heads, dim), self._dt(dt_all[t]), A,
                             B.reshape(-1, groups, state), C.reshape(-1, groups, state), D)
            y_all[t] = y.reshape(-1, self.inner)
        for chunks, keep, saves in meta.passes:  # (verified chunks also keep each token's state)
            rows, tokens, lengths, valid = padded_chunks(chunks, h.device)
            r, n = tokens.shape
            x, B, C = self._split(ops.conv_prefill(meta, name, rows, xbc_all[tokens], lengths, weight, bias, keep))
            y = ops.prefill(meta, name, rows, x.reshape(r, n, heads, dim), self._dt(dt_all[tokens]), A,
                                B.reshape(r, n, groups, state), C.reshape(r, n, groups, state), D, lengths, keep)
            y_all[tokens[valid]] = y.reshape(r, n, self.inner)[valid]
            if saves is not None:  # states at checkpoints inside chunks
                ops.save_states(meta, name, saves)
        if self.norm is not None:
            y_all = self.norm(y_all, z)
        else:
            y_all = y_all * F.silu(z.float())
        return self.out_proj(y_all.to(h.dtype))


def mamba2_mixer(config, intermediate: int | None = None, **options) -> Mamba2Mixer:
    """The Mamba-2 mixer as the configs that name it `mamba_*` describe it
    (Bamba, Granite-4.0-H, Falcon-H1)."""
    heads = config.mamba_n_heads
    inner = intermediate or config.mamba_expand * config.hidden_size
    head_dim = config.mamba_d_head if isinstance(config.mamba_d_head, int) else inner // heads
    options.setdefault("out_bias", config.mamba_proj_bias)
    return Mamba2Mixer(config.hidden_size, heads, head_dim, config.mamba_n_groups, config.mamba_d_state,
                       config.mamba_d_conv, conv_bias=config.mamba_conv_bias, in_bias=config.mamba_proj_bias,
                       eps=config.rms_norm_eps, dt_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
                       activation=config.hidden_act, **options)
