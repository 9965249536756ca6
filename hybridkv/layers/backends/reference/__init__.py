"""The torch reference: exact and simple on purpose, the oracle every other
backend is tested against (tests/test_backend_conformance.py). Attention
gathers each query's pages and runs torch products (attention.py); the
recurrent layers of every kind update gathered states (recurrent.py).
Runs everywhere."""

from __future__ import annotations

from ....core.dtypes import KV_CACHE_DTYPES
from ..base import AttentionOps, Backend, Capabilities
from . import attention
from .recurrent import recurrent_ops


class ReferenceAttention(AttentionOps):
    name = "torch"

    def build(self, step):
        return attention.build(step)

    def store(self, cache, k, v, meta, column):
        attention.store(cache, k, v, meta, column)

    def attend(self, q, cache, meta, column, scale, softcap=None, sinks=None):
        return attention.attend(q, cache, meta, column, scale, softcap, sinks)


class ReferenceBackend(Backend):
    name = "torch"
    # Every page dtype: quantized pages are widened where gathered (kv_quant.py).
    capabilities = Capabilities(dtypes=frozenset(KV_CACHE_DTYPES))

    def __init__(self):
        super().__init__(ReferenceAttention(), recurrent_ops())
