"""A decoder layer's decode step in one C call (kernels.c `decode_layer`):
norms, the q/k/v product, q/k norms and rotary, the K/V store, attention,
the output product, the residual adds and the gated MLP, for a step whose
every sequence has one token and which has few of them; with more, the
same layer in stages between the modules' own products (`layer_stage`).

Why: at batch 1 a step reads every weight once, and the rest should be
free. Through torch's modules it is not: per layer about fifteen calls from
Python (oneDNN's products, the C norms and attention, views and adds), each
waking the threads again; on the real Gemma-3 270M that was 1.3x the time
of the products alone (benchmarks/cpu_decode_step.py). Here a layer is one
call, one parallel region, and its products are matrix-vector ones that
read each weight row once for every query row.

Stages: from a dozen rows on (a few in float32) oneDNN's packed products
beat the layer's own, but through the modules a layer still spent about
fifteen calls from Python between them: a fifth of a 16-row bfloat16 step
of the real Gemma-3 270M (5 of 27 ms) went to them, not to the products.
So such a step runs each layer as five C calls between the modules' four
products (their oneDNN products, and under tensor parallelism their
all-reduces): the input norm; the q/k norms, rotary, K/V store and
attention; the residual add and the next norm; the gated activation; the
last residual add. Each computes in float32 as `decode_layer` does and
rounds to the model's dtype where it writes, which the products read.

`CpuDecoderLayer` wraps a family's decoder layer (its `parts()`, layers/
decoder.py). Whether a step runs the C calls is decided once per step by
the backend (`CpuBackend.route`: "cpu:decoder-layers" for one call a
layer, "cpu:decoder-stages" for the stages), which leaves the step's rows
(`CpuDecodeStep`) in the batch; any other step (a prefill chunk in it)
runs the wrapped layer's modules. The products read the dense weights, while
oneDNN's batched products read packed ones (linear.py): a wrapped layer
keeps both copies, so layers are wrapped only where the machine has four
times the dense weights free (under tensor parallelism: on every rank, so
that every rank runs the same route).

Under tensor parallelism a rank's layer holds its share of the heads and
of the MLP's width, so its output products are partial sums, which the
residual adds and the norms after them need whole: the layer then runs as
three C calls (kernels.c `decode_layer`'s parts) with an all-reduce of the
sums between them, the same two all-reduces as the modules make.

In bfloat16 the products read half the bytes of float32 (a batch-1 step's
time); where the CPU has AVX-512 BF16 they run on its bfloat16 dot
product, their inputs rounded to bfloat16 as the modules' Linear reads
them (kernels.c `layer_products`: at 4 rows a layer in 0.17 ms where
widening each weight took 0.33, oneDNN's four products alone 0.19, the
weights in cache), over a copy of the weights laid out in tiles of four
rows at load (`tiles`: one run of memory per tile, not four). Everything
between the products is float32 (the norms, biases and sinks held as
float32 copies), the K/V rounded where stored and the residual stream
where each sublayer is added. The modules round after every op, so the
two agree to bfloat16 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...decoder import DecoderParts
from ...mlp import GatedMLP
from ...kv_quant import QuantizedCache
from .attention import CODES, STORAGE, CpuMetadata, paged_cache
from .modules import ACTIVATIONS

# Above this many query rows a decode step runs the layers in stages between
# oneDNN's packed products, which then beat the one-call layers'
# matrix-vector ones: on the real Gemma-3 270M in float32 (2-core EPYC, the
# two routes taking turns in one engine, 128-token prompts) 3-row steps
# 32.3 ms one way and 32.2 the other, 4 rows 31.3 against 29.7, 2 rows
# 30.0 against 30.4.
MAX_ROWS = 3
# Where bfloat16 products run on the CPU's dot product, the one-call layers
# keep up to more rows: 11 rows 21.7 ms against the stages' 22.0, 12 rows
# 23.1 against 22.6, 15 rows 26.1 against 24.2 (as above, weights in tiles).
MAX_ROWS_NATIVE_BF16 = 11


def tiled(lib, dtype: torch.dtype) -> bool:
    """Whether the C layer's products read their weights in tiles
    (`tiles`): the bfloat16 ones on the CPU's dot product."""
    return dtype == torch.bfloat16 and bool(lib.native_bf16_products)


def tiles(weight: torch.Tensor) -> torch.Tensor:
    """A product's weight [n, k] laid out as kernels.c's tiled products read
    it: [n / 4, k / 32, 4, 32], four rows' next 32 elements side by side,
    n rounded up to 4 rows and k to 32 columns with zeros (flat)."""
    n, k = weight.shape
    padded = torch.zeros((n + 3) // 4 * 4, (k + 31) // 32 * 32, dtype=weight.dtype)
    padded[:n, :k] = weight
    return padded.view(-1, 4, padded.shape[1] // 32, 32).transpose(1, 2).contiguous().view(-1)


def layer_weights(lib, dtype: torch.dtype, qkv, o, gate_up, down, inter: int) -> dict[str, torch.Tensor]:
    """The four products' weights as the C layer reads them: dense, or in
    tiles (gate's rows, then up's, each in whole tiles)."""
    if not tiled(lib, dtype):
        return {"qkv": qkv, "o": o, "gate_up": gate_up, "down": down}
    return {"qkv": tiles(qkv), "o": tiles(o), "gate_up": torch.cat([tiles(gate_up[:inter]), tiles(gate_up[inter:])]),
            "down": tiles(down)}


def max_rows(lib, dtype: torch.dtype) -> int:
    """The most rows a step may have to run the one-call layers."""
    return MAX_ROWS_NATIVE_BF16 if dtype == torch.bfloat16 and lib.native_bf16_products else MAX_ROWS
# kernels.c's parts of `decode_layer`: the whole layer, or the three that a
# tensor-parallel rank runs with an all-reduce of their sums between them.
LAYER_WHOLE, LAYER_PARTS = 0, (1, 2, 3)
# kernels.c's stages of `layer_stage`, between the four products.
STAGE_INPUT, STAGE_ATTEND, STAGE_MID, STAGE_ACT, STAGE_END = range(5)


def _dense(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype in STORAGE and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0)


def refusal(parts: DecoderParts) -> str | None:
    """Why `decode_layer` cannot run a layer of these parts, or None."""
    attn, mlp, norms = parts.attention, parts.mlp, parts.norms()
    if not isinstance(mlp, GatedMLP):
        # gpt-oss: experts chosen per token, each a product of its own (the C layer's one dense MLP is not that)
        return "a mixture-of-experts feed-forward" if hasattr(mlp, "experts") else f"feed-forward {type(mlp).__name__}"
    if attn.qkv_proj is None or mlp.gate_up_proj is None:
        return "projections not fused"
    if mlp.down_proj.ranks != attn.ranks or not mlp.down_proj.reduce:
        return "an MLP whose partial sums another module adds"
    if mlp.kind not in ACTIVATIONS:
        return f"activation {mlp.kind}"
    if len({(n.eps, n.unit_offset) for n in norms}) != 1:
        return "norms of different conventions"
    if attn.num_heads % attn.num_kv_heads or attn.head_dim % 2:
        return "head layout"
    if len(attn.columns) > 1:
        return "K/V cut by heads where pages end (mixed page dtypes: core/layout.py)"
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(_dense(t) for m in linears for t in (m.weight, m.bias)) or not all(_dense(n.weight) for n in norms) \
            or not _dense(attn.sinks):
        return "weights not dense float32 or bfloat16 on the CPU"
    if len({m.weight.dtype for m in linears}) != 1:
        return "products' weights of different dtypes"
    return None


def dense_bytes(parts: DecoderParts) -> int:
    attn, mlp = parts.attention, parts.mlp
    return sum(m.weight.numel() * m.weight.element_size()
               for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))


@dataclass
class GroupRows:
    """One attention group's decode rows as `decode_layer` reads them."""

    store_pages: torch.Tensor  # [width, R] int64: the page of each row's new token, per column
    offsets: torch.Tensor  # [R] int64: its slot in the page
    pages: torch.Tensor  # [width, R, blocks] int64 (attention.CpuDecodes)
    first: torch.Tensor  # [R] int64
    last: torch.Tensor  # [R] int64
    structs: dict = field(default_factory=dict)  # columns -> kernels.c's decode_rows, made once per step

    def rows(self, lib, column: int, scale_column: int | None = None):
        """kernels.c's decode_rows through the pages of `column` (and the
        scales' of `scale_column`, where quantized pages keep them apart)."""
        made = self.structs.get((column, scale_column))
        if made is None:
            pages = self.pages[column]
            apart = {} if scale_column is None else {
                "scale_pages": self.pages[scale_column].data_ptr(),
                "store_scale_pages": self.store_pages[scale_column].data_ptr()}
            made = self.structs[column, scale_column] = lib.structs["decode_rows"](
                rows=pages.shape[0], max_blocks=pages.shape[1], pages=pages.data_ptr(), first=self.first.data_ptr(),
                last=self.last.data_ptr(), store_pages=self.store_pages[column].data_ptr(),
                store_offsets=self.offsets.data_ptr(), **apart)
        return made


@dataclass
class CpuDecodeStep:
    """What the step's C layers read: the pool and each group's rows;
    `stages`: the layers run in stages between the modules' products
    (`layer_stage`), not as one call each."""

    buffers: object
    groups: dict[int, GroupRows]
    threads: int
    stages: bool = False


def decode_step(batch, rows: int) -> CpuDecodeStep | None:
    """The step's rows if it is one the C layers run (eager, decodes only,
    every group on the cpu attention): as one call each up to `rows` rows,
    in stages above; else None."""
    inputs = batch.inputs
    if inputs.fixed_shape or inputs.chunks is not None or inputs.decodes is None or torch.compiler.is_compiling():
        return None
    groups = {}
    for group, meta in batch.attention.items():
        if not isinstance(meta, CpuMetadata) or meta.decodes is None:
            return None
        ref, dec = meta.reference, meta.decodes
        groups[group] = GroupRows(ref.store_pages.to(torch.int64).contiguous(),
                                  ref.store_offsets.to(torch.int64).contiguous(), dec.pages, dec.first, dec.last)
    return CpuDecodeStep(batch.buffers, groups, torch.get_num_threads(), len(inputs.input_ids) > rows)


class CpuDecoderLayer(nn.Module):
    """A family's decoder layer, run as one C call on the steps the backend
    routes that way and through its own modules on every other."""

    def __init__(self, layer: nn.Module, lib, parts: DecoderParts):
        super().__init__()
        self.layer = layer
        self.lib = lib
        attn, mlp, norms = parts.attention, parts.mlp, parts.norms()
        # Their products run the steps in stages (looked up then: packing swaps them after this).
        self.attention, self.mlp = attn, mlp
        # Where the layer's K/V lives (bound by the worker before prepare).
        self.layer_name, self.group, self.column = attn.layer_name, attn.group, attn.column
        self.ranks = attn.ranks  # the tensor-parallel ranks its partial sums are added up over
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

        def vector(t):  # norms, biases and sinks: float32 (a copy where they are bfloat16)
            return None if t is None else t.detach().float()

        # The tensors the struct points into, held here: they outlive the
        # modules' dense copies, which packing for oneDNN drops.
        self.dtype = qkv.weight.dtype  # the products' weights', and the residual stream's
        self.tensors = {
            **layer_weights(lib, self.dtype, qkv.weight.detach(), o.weight.detach(), gate_up.weight.detach(),
                            down.weight.detach(), down.in_features),
            "qkv_bias": vector(qkv.bias), "o_bias": vector(o.bias), "sinks": vector(attn.sinks),
            # the keys stored less it (kv_quant.KeyCentre; measured in place, after this)
            "k_centre": None if attn.key_centre is None else attn.key_centre.values,
            **{name: None if getattr(parts, name) is None else vector(getattr(parts, name).weight)
               for name in ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm",
                            "q_norm", "k_norm")}}
        self.weights = lib.structs["decoder_layer"](
            hidden=o.out_features, q_heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            inter=down.in_features, activation=ACTIVATIONS[mlp.kind], dtype=STORAGE[self.dtype], eps=norms[0].eps,
            norm_offset=1.0 if norms[0].unit_offset else 0.0, scale=attn.scale, softcap=attn.softcap or 0.0,
            tiled=int(tiled(lib, self.dtype)),
            **{name: None if t is None else t.data_ptr() for name, t in self.tensors.items()})
        self._cache: tuple | None = None  # (pool, the layer's paged_cache) of the last step
        # The column of its scales where its quantized pages keep them apart (set with its cache).
        self.scale_column: int | None = None

    def cache(self, buffers):
        """The layer's `paged_cache` (made once per pool)."""
        if self._cache is None or self._cache[0] is not buffers.pool:
            cache = buffers.attention_cache(self.layer_name)
            if isinstance(cache, QuantizedCache) and cache.dtype not in CODES or \
                    not isinstance(cache, QuantizedCache) and (cache.dtype not in STORAGE or cache.stride(-1) != 1):
                raise ValueError(f"the C decoder layer writes float32, bfloat16, int8 or float8 K/V; {self.layer_name}'s "
                                 f"cache is {cache.dtype}")
            self._cache = (buffers.pool, paged_cache(self.lib, cache), cache)
            self.scale_column = cache.scale_column if isinstance(cache, QuantizedCache) else None
        return self._cache[1]

    def forward(self, x: torch.Tensor, cos_sin, batch) -> torch.Tensor:
        step = batch.route_state
        if not isinstance(step, CpuDecodeStep):
            return self.layer(x, cos_sin, batch)
        # x [rows, hidden] contiguous, and cos, sin [rows, head_dim], of the
        # weights' dtype (the model's): x updated in place and returned.
        cos, sin = cos_sin
        if not x.dtype == cos.dtype == sin.dtype == self.dtype:
            raise ValueError(f"the C decoder layer reads {self.dtype}; got {x.dtype}, cos and sin {cos.dtype}")
        cache = self.cache(step.buffers)
        rows = step.groups[self.group].rows(self.lib, self.column, self.scale_column)
        call = (self.weights, cache, rows, x.data_ptr(), cos.data_ptr(), sin.data_ptr())
        if step.stages:
            return self._stages(x, call, step.threads)
        if self.ranks.world == 1:
            self._check(self.lib.decode_layer(*call, None, LAYER_WHOLE, step.threads))
            return x
        sums = torch.empty(x.shape, dtype=torch.float32)  # kernels.c adds float32 partial sums
        for part in LAYER_PARTS:
            self._check(self.lib.decode_layer(*call, sums.data_ptr(), part, step.threads))
            if part != LAYER_PARTS[-1]:
                self.ranks.all_reduce(sums)
        return x

    def _stages(self, x: torch.Tensor, call: tuple, threads: int) -> torch.Tensor:
        """The layer with the modules' own products (oneDNN's, batched; under
        tensor parallelism their all-reduces too) and kernels.c's
        `layer_stage` between them: x updated in place."""
        attn, mlp, stage = self.attention, self.mlp, self.lib.layer_stage

        def between(product: torch.Tensor | None, width: int, which: int) -> torch.Tensor | None:
            out = None if width == 0 else torch.empty(x.shape[0], width, dtype=self.dtype)
            product = None if product is None else product.contiguous()  # (held: C reads it)
            self._check(stage(*call, None if product is None else product.data_ptr(),
                              None if out is None else out.data_ptr(), which, threads))
            return out

        h = between(None, x.shape[1], STAGE_INPUT)
        heads = between(attn.qkv_proj(h), attn.num_heads * attn.head_dim, STAGE_ATTEND)
        h = between(attn.o_proj(heads), x.shape[1], STAGE_MID)
        act = between(mlp.gate_up_proj(h), mlp.down_proj.in_features, STAGE_ACT)
        between(mlp.down_proj(act), 0, STAGE_END)
        return x

    @staticmethod
    def _check(status: int) -> None:
        if status != 0:
            raise MemoryError("hybridkv's CPU decoder layer could not allocate its scratch (or refused its "
                              "weights' layout: decoder_layer.tiled)")


def wrap_decoder_layers(model: nn.Module, lib, free_bytes: int, report) -> int:
    """Wrap every decoder layer (a module whose `parts()` describes it) in
    a CpuDecoderLayer, or none: a step runs every layer one way or the
    other. Returns how many."""
    layers = [(parent, name, child) for parent in list(model.modules())
              for name, child in parent.named_children() if hasattr(child, "parts")]
    parts = {id(layer): layer.parts() for _, _, layer in layers}
    if not layers or any(p is None for p in parts.values()):
        report.declined.append("one-call decoder layers: the model's layers describe no DecoderParts "
                               "(layers/decoder.py)")
        return 0
    refused = {why for p in parts.values() if (why := refusal(p)) is not None}
    if refused:
        report.declined.append(f"one-call decoder layers: {', '.join(sorted(refused))}")
        return 0
    size = sum(dense_bytes(p) for p in parts.values())
    # (Every rank reaches this with the same parts; the free memory is its own.)
    if not next(iter(parts.values())).attention.ranks.agree(free_bytes >= 4 * size):
        report.declined.append(f"one-call decoder layers: their dense weights ({size / 2**20:.0f} MiB) are kept "
                               f"beside the packed ones, and under 4x that is free")
        return 0
    for parent, name, layer in layers:
        setattr(parent, name, CpuDecoderLayer(layer, lib, parts[id(layer)]))
    rows = max_rows(lib, next(iter(parts.values())).attention.qkv_proj.weight.dtype)
    report.done.append(f"{len(layers)} decoder layers run as one C call on decode steps of up to {rows} rows "
                       f"(dense weights kept: {size / 2**20:.0f} MiB)")
    return len(layers)
