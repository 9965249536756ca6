"""FlashInfer's two paged wrappers as documented, computed by `emulate`
(layers/backends/flashinfer/attention.py): stands in for the library on the CPU, so
that the backends built on it run whole there (their argument conversion is
checked against the reference in test_flashinfer_attention.py)."""

from __future__ import annotations

import types

import torch

from hybridkv.layers.backends.flashinfer.attention import PagedArgs, emulate


class _Wrapper:
    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.planned = None

    def _plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
              window_left=-1, logits_soft_cap=None, sm_scale=None, **_):
        self.planned = (qo_indptr, PagedArgs(indptr, indices, last_page_len), window_left, sm_scale,
                        logits_soft_cap, num_qo_heads, num_kv_heads, head_dim)

    def run(self, q, kv):
        qo_indptr, args, window, scale, softcap, heads, kv_heads, dim = self.planned
        assert q.shape[1:] == (heads, dim) and kv[0].shape[2:] == (kv_heads, dim)
        if qo_indptr is None:  # decode: one query per request
            qo_indptr = torch.arange(len(q) + 1, dtype=torch.int32)
        return emulate(q, kv[0], kv[1], qo_indptr.cpu(), args, window, scale, softcap)


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, *rest, **kw):
        self._plan(None, indptr, indices, last_page_len, *rest, **kw)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, indptr, indices, last_page_len, *rest, causal=True, **kw):
        assert causal
        self._plan(qo_indptr, indptr, indices, last_page_len, *rest, **kw)


def module() -> types.ModuleType:
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    fake.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    return fake
