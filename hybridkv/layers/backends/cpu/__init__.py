"""The "cpu" backend: the reference's algorithms, with the hot parts of a
CPU step in hybridkv's C kernels (kernels.c) and oneDNN's products:

* decode attention reads each query's keys where they lie in the pool
  (attention.py); so does bfloat16 prefill attention on CPUs with AMX
  (`prefill_attention`: 16 queries at a time on the tile unit); stores and
  other prefill attention stay the reference's, but for each prefill
  tile's softmax: one C pass (`masked_softmax`);
* the gated delta rule (Gated DeltaNet) token by token on the states in
  place (recurrent.py); the other recurrent kinds run the reference's ops;
* RMS norms, Gemma's q/k norm + rotary and the gated activation in one C
  pass each (modules.py, swapped in for the shared modules);
* whole decoder layers as one C call on decode steps of up to three rows
  (eleven in bfloat16 on AVX-512 BF16), and as five C calls between
  oneDNN's products on larger decode steps (decoder.py: the routes
  "cpu:decoder-layers" and "cpu:decoder-stages"; steps with a prefill
  chunk run the modules, "cpu:modules");
* every Linear over oneDNN's packed weights (linear.py).

The kernels are built for the machine at install time or by `hybridkv
build-kernels` (build.py), loaded with their boundary read from the C
source (library.py) and self-tested against torch (check.py) before use;
where any of that fails, constructing the backend raises `Unavailable`
with the reason.
"""

from __future__ import annotations

import torch

from ....core.dtypes import KV_CACHE_DTYPES
from ..base import Backend, Capabilities, PrepareReport


class Unavailable(RuntimeError):
    """The C kernels cannot run here (not built, not loadable, or failing
    their self-test); the message says which."""


_checked: dict = {}


def kernels():
    """The loaded, self-tested library (once per process)."""
    from . import build, check, library

    try:
        lib = library.load()
    except (OSError, ImportError) as error:
        raise Unavailable(f"its C kernels could not be loaded: {error}") from None
    if lib is None:
        how = "`hybridkv build-kernels` builds them" if build.compiler() else "no C compiler here to build them"
        raise Unavailable(f"its C kernels are not built for this machine ({how})")
    if lib.path not in _checked:
        try:
            check.check(lib)
            _checked[lib.path] = None
        except AssertionError as error:
            _checked[lib.path] = str(error)
    if _checked[lib.path] is not None:
        raise Unavailable(f"its C kernels failed their self-test: {_checked[lib.path]}")
    return lib


class CpuBackend(Backend):
    name = "cpu"
    # Quantized pages (int8, float8) in its C kernels.
    capabilities = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset(KV_CACHE_DTYPES), capturable=False)

    def __init__(self):
        from .attention import CpuAttention
        from .recurrent import recurrent_ops

        self.lib = kernels()
        super().__init__(CpuAttention(self.lib), recurrent_ops(self.lib))

    def prepare(self, model, layout, device) -> PrepareReport:
        from ...dtypes import TORCH_DTYPES
        from .attention import CODES, STORAGE
        from .decoder import max_rows, wrap_decoder_layers
        from .head import tile_head
        from .linear import pack_linears, spare_memory
        from .modules import swap_norms_and_mlps

        report = super().prepare(model, layout, device)
        # The kernels read float32 and bfloat16 (STORAGE); anything else runs torch's ops, said here.
        dtype = next(model.parameters()).dtype
        pages = {g.spec.dtype for g in layout.groups if not g.recurrent}
        unread = sorted(d for d in pages if TORCH_DTYPES.get(d) not in STORAGE and TORCH_DTYPES.get(d) not in CODES)
        if unread or (layout.groups and dtype not in STORAGE):
            what = ", ".join([f"{c} caches" for c in unread] + ([f"{dtype} queries"] if dtype not in STORAGE else []))
            report.declined.append(f"C decode attention: it reads float32 and bfloat16 queries, and float32, "
                                   f"bfloat16, int8 and float8 caches; {what} run the reference")
        if dtype not in STORAGE:
            report.declined.append(f"C norms, rotary and activations: they read float32 and bfloat16; {dtype} runs "
                                   f"torch's")
        if dtype == torch.bfloat16 and any(not g.recurrent for g in layout.groups):
            report.done.append("bfloat16 prefill attention on AMX tiles, one C call a layer"
                               if self.lib.amx_prefill_attention else
                               "bfloat16 prefill attention in query tiles of oneDNN products and a C softmax ("
                               + ("Linux refused AMX's tile state" if self.lib.amx_refused else
                                  "no AMX tiles on this CPU") + ")")
        norms, mlps = swap_norms_and_mlps(model, self.lib)
        report.done.append(f"{norms} RMS norms and {mlps} gated MLPs run their elementwise work in C")
        # Before packing: a wrapped layer takes the dense weights packing drops.
        if unread:  # the one-call layers store and read K/V through the same kernels
            report.declined.append(f"one-call decoder layers: they write float32, bfloat16, int8 and float8 pages; "
                                   f"{', '.join(unread)} pages run the modules")
            wrapped = False
        else:
            wrapped = wrap_decoder_layers(model, self.lib, spare_memory(), report) > 0
        self.decoder_rows = max_rows(self.lib, dtype) if wrapped else 0
        pack_linears(model, report)
        tile_head(model, self.lib, self.decoder_rows, report)
        return report

    def route(self, batch) -> str:
        from .decoder import decode_step

        if batch.inputs.fixed_shape:
            return "fixed-shape"
        step = decode_step(batch, self.decoder_rows) if self.decoder_rows else None
        if step is not None and step.stages and not self.decoder_stages:
            step = None
        batch.route_state = step
        return "modules" if step is None else "decoder-stages" if step.stages else "decoder-layers"

    def row_max(self, logits):
        from .attention import STORAGE

        # kernels.c `row_max`: both cores at memory's rate, where torch's
        # max reads a [16, 262144] batch of logits in ~2 ms; bfloat16 logits
        # as the LM head wrote them (values widened, exactly, to float32).
        if logits.dtype not in STORAGE or logits.device.type != "cpu" or logits.dim() != 2 or \
                logits.stride(-1) != 1 or logits.shape[-1] == 0:
            return super().row_max(logits)
        rows = logits.shape[0]
        values = torch.empty(rows, dtype=torch.float32)
        indices = torch.empty(rows, dtype=torch.int64)
        if self.lib.row_max(logits.data_ptr(), rows, logits.shape[1], logits.stride(0), values.data_ptr(),
                            indices.data_ptr(), torch.get_num_threads(), STORAGE[logits.dtype]) != 0:
            raise MemoryError("row_max: no memory for its scratch")
        return values, indices

    # The most rows of a decode step the one-call decoder layers run, set by
    # prepare where it wrapped them (decoder.max_rows); 0: every step runs the modules.
    decoder_rows = 0
    # Larger decode steps: the wrapped layers in stages (True), or the modules
    # (False: benchmarks/cpu_decode_step.py compares the two).
    decoder_stages = True
