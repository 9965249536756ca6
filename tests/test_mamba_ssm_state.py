"""The mamba-ssm / causal-conv1d adapter (layers/backends/flashinfer/mamba_ssm.py) on the
CPU: with the two kernels' documented semantics in torch in their place,
a decode step updates the same states and gives the same outputs as the
reference's Mamba-1 ops, states on multi-page blocks read from
one page run and written to another, one sequence starting from the zero
state. The kernels themselves need a GPU."""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.core import FullAttentionSpec, MambaSpec, plan_layout
from hybridkv.layers.kv_buffers import KVBuffers
from hybridkv.layers.backends.flashinfer.mamba_ssm import MambaSsmMamba, emulated_kernels
from hybridkv.layers.backends.reference.recurrent import ReferenceMamba
from hybridkv.layers.step import StepInputs

CHANNELS, WIDTH, STATE = 24, 4, 8


def setup(seed=0):
    spec = MambaSpec(((CHANNELS, WIDTH - 1), (CHANNELS, STATE)), ("float32", "float32"))
    # An attention layer beside it makes pages small: a state spans 3 pages.
    layout = plan_layout({"attn.0": FullAttentionSpec(1, 4, "float32"), "mamba.0": spec}, 1 << 20, block_size=16)
    buffers = KVBuffers(layout)
    gen = torch.Generator().manual_seed(seed)
    width = layout.groups[1].pages_per_block
    assert width == 3
    rows = 3
    pages = 1 + np.random.default_rng(seed).permutation(layout.num_pages - 1)[:2 * rows * width]
    read = torch.from_numpy(pages[:rows * width].reshape(rows, width).copy())
    write = torch.from_numpy(pages[rows * width:].reshape(rows, width).copy())
    read[2] = 0  # a new sequence: the zero state, from the null page
    states = torch.randn(rows, layout.page_size_bytes * width // 4, generator=gen)
    buffers.pool[read[:2].reshape(-1)] = states[:2].view(torch.uint8).view(2 * width, -1)
    return layout, buffers, read, write


def run(backend, layout, buffers, read, write, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rows = read.shape[0]
    inputs = StepInputs.from_host(np.zeros(rows, dtype=np.int64), np.array([5, 9, 0]), np.ones(rows, dtype=np.int64),
                                  np.arange(rows), "cpu")
    meta = backend.build(inputs, buffers, read, write, read == 0)
    x = torch.randn(rows, CHANNELS, generator=gen)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=gen), torch.randn(CHANNELS, generator=gen)
    dt = torch.rand(rows, CHANNELS, generator=gen)
    A = -torch.rand(CHANNELS, STATE, generator=gen)
    B, C = torch.randn(rows, STATE, generator=gen), torch.randn(rows, STATE, generator=gen)
    D, gate = torch.randn(CHANNELS, generator=gen), torch.randn(rows, CHANNELS, generator=gen)
    conv = backend.conv_step(meta, "mamba.0", x, weight, bias)
    out = backend.step(meta, "mamba.0", conv, dt, A, B, C, D, gate)
    backend.finish(meta)
    return conv, out, buffers.pool[write.reshape(-1)].clone()


def test_the_adapter_with_the_kernels_semantics_equals_the_reference():
    reference = run(ReferenceMamba(), *setup())
    adapted = run(MambaSsmMamba(*emulated_kernels()), *setup())
    for ours, theirs in zip(adapted, reference):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-5, rtol=1e-5)
    assert reference[2].any()  # the written states are there


def test_without_causal_conv1d_the_conv_step_is_the_reference():
    selective_state_update, _ = emulated_kernels()
    reference = run(ReferenceMamba(), *setup())
    adapted = run(MambaSsmMamba(selective_state_update, None), *setup())
    for ours, theirs in zip(adapted, reference):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-5, rtol=1e-5)
