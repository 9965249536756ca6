"""A decoder layer's decode step in one C call on the CPU (cpu_kernels.c,
`decode_layer`): norms, the q/k/v product, q/k norms and rotary, the K/V
store, attention, the output product, the residual adds and the gated MLP,
for a step whose every sequence has one token and which has few of them.

Why: at batch 1 a step reads every weight once, and the rest should be
free. Through torch's modules it is not: per layer about fifteen calls from
Python (oneDNN's products, the C norms and attention of the "cpu" backend,
views and adds), each waking the threads again; on the real Gemma-3 270M
that was 1.3x the time of the products alone (benchmarks/cpu_decode_step.py).
Here a layer is one call, one parallel region, and its products are
matrix-vector ones that read each weight row once for every query row.

Those products read the weights dense, while oneDNN's batched products read
them packed (layers/linear.py): a bound layer keeps both copies, so binding
happens only where the machine has four times the dense weights free. Steps
with more rows than `MAX_ROWS`, with prefill chunks, or of fixed shape go
through the modules as before; so does any layer `bind` refuses (another
dtype, tensor parallelism, an activation the C side lacks).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_attention, cpu_fused
from .linear import spare_memory

# Above this many query rows a step goes through the modules: oneDNN's
# packed products then beat matrix-vector ones (benchmarks/cpu_decode_step.py).
MAX_ROWS = 4


class LayerWeights(ctypes.Structure):
    """cpu_kernels.c's `decoder_layer`, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "q_heads", "kv_heads", "head_dim", "inter",
                                                     "activation")] + \
               [(name, ctypes.c_float) for name in ("eps", "norm_offset", "scale", "softcap")] + \
               [(name, ctypes.c_void_p) for name in ("input_norm", "post_attention_norm", "pre_feedforward_norm",
                                                     "post_feedforward_norm", "q_norm", "k_norm", "qkv", "qkv_bias",
                                                     "o", "o_bias", "gate_up", "down")]


@dataclass
class Parts:
    """What a family's decoder layer is made of (modeling/): the attention
    (sublayers.PagedSelfAttention), the gated MLP, and its RMS norms. A
    post norm or a q/k norm that the family lacks is None."""

    attention: object
    mlp: object
    input_norm: object
    pre_feedforward_norm: object
    post_attention_norm: object = None
    post_feedforward_norm: object = None
    q_norm: object = None
    k_norm: object = None

    def norms(self) -> list:
        return [n for n in (self.input_norm, self.pre_feedforward_norm, self.post_attention_norm,
                            self.post_feedforward_norm, self.q_norm, self.k_norm) if n is not None]


def _dense(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0)


class NativeDecoder:
    """One layer bound to `decode_layer`: the C struct and the tensors it
    points into (held here, so they outlive the modules' dense copies)."""

    def __init__(self, lib, parts: Parts):
        attn, mlp, norms = parts.attention, parts.mlp, parts.norms()
        self.lib = lib
        self.attention = attn
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        self.tensors = {
            "qkv": qkv.weight.detach(), "qkv_bias": None if qkv.bias is None else qkv.bias.detach(),
            "o": o.weight.detach(), "o_bias": None if o.bias is None else o.bias.detach(),
            "gate_up": gate_up.weight.detach(), "down": down.weight.detach(),
            **{name: None if getattr(parts, name) is None else getattr(parts, name).weight.detach()
               for name in ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm",
                            "q_norm", "k_norm")}}
        self.weights = LayerWeights(
            hidden=o.out_features, q_heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            inter=down.in_features, activation=cpu_fused.ACTIVATIONS[mlp.kind], eps=norms[0].eps,
            norm_offset=1.0 if norms[0].unit_offset else 0.0, scale=attn.scale, softcap=attn.softcap or 0.0,
            **{name: None if t is None else t.data_ptr() for name, t in self.tensors.items()})
        self._cache: tuple | None = None  # (pool, the layer's cache view) of the last step

    @staticmethod
    def refusal(parts: Parts) -> str | None:
        """Why `decode_layer` cannot run this layer, or None."""
        attn, mlp, norms = parts.attention, parts.mlp, parts.norms()
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return "projections not fused"
        if attn.reduce is not None or mlp.reduce is not None:
            return "tensor parallel"
        if mlp.kind not in cpu_fused.ACTIVATIONS:
            return f"activation {mlp.kind}"
        if len({(n.eps, n.unit_offset) for n in norms}) != 1:
            return "norms of different conventions"
        if attn.num_heads % attn.num_kv_heads or attn.head_dim % 2:
            return "head layout"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(_dense(t) for m in linears for t in (m.weight, m.bias)) or \
                not all(_dense(n.weight) for n in norms):
            return "weights not dense float32 on the CPU"
        return None

    def cache(self, buffers) -> torch.Tensor:
        """The layer's view of the pool (made once per pool)."""
        if self._cache is None or self._cache[0] is not buffers.pool:
            cache = buffers.attention_cache(self.attention.layer_name)
            if cache.dtype != torch.float32 or cache.stride(-1) != 1:
                raise ValueError(f"the C decoder layer writes float32 K/V; {self.attention.layer_name}'s cache "
                                 f"is {cache.dtype}")
            self._cache = (buffers.pool, cache)
        return self._cache[1]

    def __call__(self, x: torch.Tensor, cos_sin, plan: "DecodePlan") -> torch.Tensor:
        """x [rows, hidden] float32, contiguous: updated in place and returned."""
        attn = self.attention
        cos, sin = cos_sin
        group = plan.groups[attn.group]
        cache = self.cache(plan.buffers)
        status = self.lib.decode_layer(
            ctypes.byref(self.weights), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(), cache.data_ptr(),
            *cache.stride()[:4], cache.shape[2], group.store_pages[attn.column].data_ptr(), group.offsets.data_ptr(),
            group.pages[attn.column].data_ptr(), group.pages.shape[2], group.first.data_ptr(), group.last.data_ptr(),
            plan.threads)
        if status != 0:
            raise MemoryError("hybridkv's CPU decoder layer could not allocate its scratch")
        return x


@dataclass
class GroupPlan:
    """One attention group's part of the step, as `decode_layer` reads it."""

    store_pages: torch.Tensor  # [width, R] int64: the page of each row's new token, per column
    offsets: torch.Tensor  # [R] int64: its slot in the page
    pages: torch.Tensor  # [width, R, blocks] int64 (cpu_attention.NativeDecodes)
    first: torch.Tensor  # [R] int64
    last: torch.Tensor  # [R] int64


@dataclass
class DecodePlan:
    buffers: object
    groups: dict[int, GroupPlan]
    threads: int


def plan(batch, layers) -> DecodePlan | None:
    """The step's plan if every layer of `layers` is bound and the step is
    one the C layer runs (eager, decodes only, at most MAX_ROWS); else None."""
    inputs = batch.inputs
    if inputs.fixed_shape or inputs.chunks is not None or inputs.decodes is None or \
            len(inputs.input_ids) > MAX_ROWS or torch.compiler.is_compiling():
        return None
    if not all(getattr(layer, "native_decoder", None) is not None for layer in layers):
        return None
    groups = {}
    for group, meta in batch.attention.items():
        if not isinstance(meta, cpu_attention.NativeMetadata) or meta.decodes is None:
            return None
        ref, dec = meta.reference, meta.decodes
        groups[group] = GroupPlan(ref.store_pages.to(torch.int64).contiguous(),
                                  ref.store_offsets.to(torch.int64).contiguous(), dec.pages, dec.first, dec.last)
    return DecodePlan(batch.buffers, groups, torch.get_num_threads())


def configure(model: torch.nn.Module, lib) -> int:
    """Bind a NativeDecoder to every layer whose `native_parts()` it can
    run, if the machine has four times their dense weights free (they are
    kept beside oneDNN's packed copies); returns how many."""
    layers = [m for m in model.modules() if hasattr(m, "native_parts")]
    parts = {layer: layer.native_parts() for layer in layers}
    runnable = {layer: p for layer, p in parts.items() if NativeDecoder.refusal(p) is None}
    if len(runnable) != len(layers):  # a step runs every layer one way or the other
        return 0
    size = sum(m.weight.numel() * 4 for p in runnable.values()
               for m in (p.attention.qkv_proj, p.attention.o_proj, p.mlp.gate_up_proj, p.mlp.down_proj))
    if spare_memory() < 4 * size:
        return 0
    for layer, p in runnable.items():
        layer.native_decoder = NativeDecoder(lib, p)
    return len(runnable)
