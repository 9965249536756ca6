"""One conformance suite for every backend that runs on this machine: the
same step-level cases through each backend's declared ops
(layers/backends/base.py), each equal to the torch reference's.

Backends: "cpu" (its C kernels), "triton" (under triton's interpreter on
the CPU), FlashInfer's attention through its documented semantics
(tests/fake_flashinfer.py: its argument conversion), and the reference
itself (against dense torch written from the read rule, so the oracle is
checked too). Cases: decodes, prefill chunks continuing after cached
tokens and mixed steps; full, sliding-window and chunked-local layers;
soft-capping; attention sinks; GQA; fixed-shape decode steps; float32 and
bfloat16 caches; recurrent states of every kind (Mamba-1, Mamba-2's SSD, the
gated short conv, Gated DeltaNet's gated delta rule) stepped, prefilled and
rolled back after verified drafts.
Slots no query of the step may see hold NaN for a backend that declares it
loads only visible keys, so one that reads outside a query's range shows
it; the others (the reference and what reuses it) gather whole blocks and
mask them, so there the slots hold large finite garbage (the stores keep
them finite in the engine), which an unmasked read would show instead.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any import of the kernels

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hybridkv.core import ChunkedLocalSpec, FullAttentionSpec, RecurrentSpec, SlidingWindowSpec, plan_layout  # noqa: E402
from hybridkv.layers.backends import PrepareReport, choose  # noqa: E402
from hybridkv.layers.backends.reference import ReferenceBackend  # noqa: E402
from hybridkv.layers.kv_buffers import KVBuffers  # noqa: E402
from hybridkv.layers.step import StepBatch, StepInputs, attention_step  # noqa: E402


def _flashinfer_fake():
    import fake_flashinfer

    from hybridkv.layers.backends.flashinfer import FlashInferBackend
    from hybridkv.layers.backends.flashinfer.attention import FlashInferAttention

    class Fake:
        name = "flashinfer"
        attention = FlashInferAttention(fake_flashinfer.module(), torch.device("cpu"))
        recurrent = None
        kinds = ("full", "sliding_window")
        dtypes = (torch.bfloat16, torch.float16)
        capabilities = FlashInferBackend.capabilities
    return Fake()


def available() -> list[str]:
    names = ["torch", "cpu"]
    try:
        import triton  # noqa: F401

        names.append("triton")
    except ImportError:
        pass
    return names + ["flashinfer"]


def backend(name: str):
    if name == "flashinfer":
        return _flashinfer_fake()
    if name == "cpu":
        return choose("cpu", "cpu")  # a RuntimeError (a failure) where the C kernels are not built
    if name == "triton":
        return choose("triton", "cpu")
    return ReferenceBackend()


BACKENDS = available()


def runs(b, spec, dtype, sinks: bool = False) -> bool:
    """Whether backend `b` declares it runs layers of `spec` with `dtype`
    caches (and attention sinks, where `sinks`)."""
    if hasattr(b, "kinds"):  # the FlashInfer stand-in
        return spec.kind in b.kinds and dtype in b.dtypes and (not sinks or b.capabilities.sinks)
    return b.refusal(spec, torch.device("cpu"), sinks) is None


# -- attention ------------------------------------------------------------------------
# (cached tokens, new tokens) per sequence: a fresh chunk, a chunk after
# cached tokens across block boundaries, decodes long past a window, at a
# block's first slot, and the very first token.
MIXED = [(0, 9), (37, 21), (70, 1), (32, 1), (0, 1)]
DECODES = [(70, 1), (32, 1), (0, 1), (5, 1)]
SPECS = {"full": FullAttentionSpec(2, 16), "window-5": SlidingWindowSpec(2, 16, sliding_window=5),
         "window-23": SlidingWindowSpec(2, 16, sliding_window=23), "chunked-24": ChunkedLocalSpec(2, 16, chunk_size=24)}


class AttentionCase:
    """Sequences' blocks on random pages of one layer's cache, released
    blocks as the null page, table rows shuffled; every slot NaN except the
    keys some query of the step may read."""

    def __init__(self, spec, step, dtype, bs=8, q_heads=4, seed=0, fixed=False):
        gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        rng = np.random.default_rng(seed)
        self.spec, self.step, self.dtype, self.bs = spec, step, dtype, bs
        kv_heads, dim = spec.num_kv_heads, spec.head_size
        blocks = [-(-(cached + count) // bs) for cached, count in step]
        self.cache = torch.full((1 + sum(blocks) + 2, 2, bs, kv_heads, dim), float("nan"), dtype=dtype)
        free = rng.permutation(np.arange(1, self.cache.shape[0]))
        rows = rng.permutation(len(step) + 2)[:len(step)]
        table = np.zeros((1, len(step) + 2, max(blocks) + 1), dtype=np.int64)
        taken = 0
        for (cached, count), nb, row in zip(step, blocks, rows):
            pages = free[taken:taken + nb].copy()
            taken += nb
            live = spec.first_visible(cached)
            pages[(np.arange(nb) + 1) * bs <= live] = 0  # released blocks: the null page
            table[0, row, :nb] = pages
            for pos in range(live, cached):  # the cached keys a query may read
                self.cache[pages[pos // bs], :, pos % bs] = torch.randn(2, kv_heads, dim, generator=gen).to(dtype)
        self.table = torch.from_numpy(table)
        tokens = sum(count for _, count in step)
        self.q = torch.randn(tokens, q_heads, dim, generator=gen).to(dtype)
        self.k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
        self.v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
        counts = np.array([c for _, c in step])
        inputs = StepInputs.from_host(np.zeros(tokens, dtype=np.int64), np.array([c for c, _ in step]), counts,
                                      rows, "cpu")
        if fixed:
            assert all(c == 1 for c in counts)
            inputs = StepInputs.fixed(inputs.input_ids, inputs.positions, inputs.table_rows,
                                      torch.arange(len(step)))
        self.inputs = inputs
        self.attention_step = attention_step(inputs, self.table, spec, bs)
        # Attention sinks, one per query head, some far above the scores
        # (their heads keep little weight for the keys), some far below.
        self.sinks = (torch.randn(q_heads, generator=gen) * 3).to(dtype)

    def run(self, ops, scale, softcap, poison=True, sinks=None):
        """(output, cache after the store) through `ops`; unseen slots NaN
        (`poison`), else large finite garbage."""
        cache = self.cache.clone()
        if not poison:
            gen = torch.Generator().manual_seed(self.seed + 1)
            garbage = (torch.randn(cache.shape, generator=gen) * 1e3).to(cache.dtype)
            cache = torch.where(cache.isnan(), garbage, cache)
        meta = ops.build(self.attention_step)
        ops.store(cache, self.k, self.v, meta, 0)
        return ops.attend(self.q, cache, meta, 0, scale, softcap, sinks), cache

    def dense(self, scale, softcap, sinks=None):
        """Dense torch from the read rule: query at p reads keys
        first_visible(p) .. p, the new ones included; a sink is one more
        logit of its head's softmax, with no value."""
        out = torch.empty(self.q.shape, dtype=torch.float32)
        row, groups = 0, self.q.shape[1] // self.spec.num_kv_heads
        cache = self.cache.float()
        table = self.table[0]
        for seq, (cached, count) in enumerate(self.step):
            keys = torch.empty(cached + count, *self.k.shape[1:])
            values = torch.empty_like(keys)
            table_row = int(self.inputs.table_rows[seq])
            for pos in range(cached):
                page = int(table[table_row, pos // self.bs])
                keys[pos], values[pos] = cache[page, 0, pos % self.bs], cache[page, 1, pos % self.bs]
            keys[cached:], values[cached:] = self.k[row:row + count].float(), self.v[row:row + count].float()
            for i in range(count):
                p = cached + i
                lo = self.spec.first_visible(p)
                k = keys[lo:p + 1].repeat_interleave(groups, 1)
                v = values[lo:p + 1].repeat_interleave(groups, 1)
                s = torch.einsum("hd,nhd->hn", self.q[row + i].float(), k) * scale
                if softcap:
                    s = torch.tanh(s / softcap) * softcap
                if sinks is not None:
                    weights = torch.cat([s, sinks.float()[:, None]], -1).softmax(-1)[:, :-1]
                else:
                    weights = s.softmax(-1)
                out[row + i] = torch.einsum("hn,nhd->hd", weights, v)
            row += count
        return out


TOLERANCE = {torch.float32: dict(atol=3e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def kernel_calls(name, b, monkeypatch) -> list | None:
    """The cpu backend's calls of its C decode attention, counted (None for
    the others): its decodes run there, in float32 and bfloat16 alike, not
    through the reference's fallback."""
    if name != "cpu":
        return None
    calls, kernel = [], b.attention.lib.decode_attention

    def counted(*args):
        calls.append(args)
        return kernel(*args)
    monkeypatch.setattr(b.attention.lib, "decode_attention", counted)
    return calls


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("shape", ["mixed", "decodes", "fixed-shape"])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_equals_the_reference(name, spec, shape, softcap, dtype, monkeypatch):
    spec = SPECS[spec]
    b = backend(name)
    if not runs(b, spec, dtype):
        pytest.skip(f"{name} declares it does not run {spec.kind} attention on {dtype} caches")
    case = AttentionCase(spec, MIXED if shape == "mixed" else DECODES, dtype, fixed=shape == "fixed-shape")
    expected, expected_cache = case.run(ReferenceBackend().attention, 0.3, softcap, poison=False)
    calls = kernel_calls(name, b, monkeypatch)
    got, cache = case.run(b.attention, 0.3, softcap, poison=b.capabilities.reads_only_visible_keys)
    assert calls is None or bool(calls) == (shape != "fixed-shape")  # fixed shapes are the reference's
    assert got.dtype == case.q.dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
    # The new K/V is where the reference put it.
    pages, offsets = case.attention_step.store_pages[0], case.attention_step.store_offsets
    assert torch.equal(cache[pages, :, offsets], expected_cache[pages, :, offsets])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("shape", ["mixed", "decodes", "fixed-shape"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_with_sinks_equals_the_reference(name, spec, shape, dtype, monkeypatch):
    # gpt-oss's attention sinks: a logit per query head in each softmax's
    # denominator. A backend that ignores them is far off here (the sinks
    # are several times the scores).
    spec = SPECS[spec]
    b = backend(name)
    if not runs(b, spec, dtype, sinks=True):
        pytest.skip(f"{name} declares it does not run {spec.kind} attention with sinks on {dtype} caches")
    case = AttentionCase(spec, MIXED if shape == "mixed" else DECODES, dtype, fixed=shape == "fixed-shape", seed=4)
    softcap = 5.0 if shape == "mixed" else None  # sinks beside a soft-cap too
    expected, _ = case.run(ReferenceBackend().attention, 0.3, softcap, poison=False, sinks=case.sinks)
    without, _ = case.run(ReferenceBackend().attention, 0.3, softcap, poison=False)
    assert (expected.float() - without.float()).abs().max() > 0.1  # the sinks matter in this case
    calls = kernel_calls(name, b, monkeypatch)
    got, _ = case.run(b.attention, 0.3, softcap, poison=b.capabilities.reads_only_visible_keys, sinks=case.sinks)
    assert calls is None or bool(calls) == (shape != "fixed-shape")
    assert got.dtype == case.q.dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


def test_flashinfer_declares_no_sinks_and_the_engine_check_names_the_group():
    from hybridkv.layers.backends.flashinfer import FlashInferBackend, TritonFlashInferBackend

    assert FlashInferBackend.capabilities.sinks is False and TritonFlashInferBackend.capabilities.sinks is True
    layout = plan_layout({"layers.0": SPECS["window-5"], "layers.1": SPECS["full"]}, memory_bytes=1 << 20,
                         block_size=8)

    class Layer:
        def __init__(self, sinks):
            self.sinks = sinks

    class Model:
        def cache_layers(self):
            return {"layers.0": Layer(torch.zeros(4)), "layers.1": Layer(None)}

    fake = FlashInferBackend.__new__(FlashInferBackend)
    with pytest.raises(ValueError, match=r"group \d \(sliding_window\): no attention sinks") as refused:
        fake.check_layout(layout, "cuda", Model())
    assert "full" not in str(refused.value)  # the group without sinks is not refused
    fake.check_layout(layout, "cuda")  # no model: the cache alone, which it takes
    ReferenceBackend().check_layout(layout, "cpu", Model())


def test_the_backends_that_say_they_load_only_visible_keys_are_poisoned():
    # (so the NaN cases above test something for them)
    declared = {name: backend(name).capabilities.reads_only_visible_keys for name in BACKENDS}
    assert declared["torch"] is False  # it gathers whole blocks (FlashInfer whole pages) and masks them
    if "triton" in declared:
        assert declared["triton"] is True


@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_the_reference_equals_dense_attention_from_the_read_rule(spec, softcap, sinks):
    case = AttentionCase(SPECS[spec], MIXED, torch.float32, seed=3)
    sinks = case.sinks if sinks else None
    got, _ = case.run(ReferenceBackend().attention, 0.3, softcap, poison=False, sinks=sinks)
    torch.testing.assert_close(got, case.dense(0.3, softcap, sinks), atol=3e-5, rtol=1e-4)


# -- recurrent states ---------------------------------------------------------------
def _mamba(ops, meta, layer, inputs, rows_of, chunks_of, keep):
    """A Mamba-1 mixer's calls: conv, then the selective scan, gated."""
    x, dt, B, C, gate = inputs
    if rows_of is not None:  # one token for each decode row
        t = rows_of
        xc = ops.conv_step(meta, layer, x[t], W["weight"], W["bias"])
        return ops.step(meta, layer, xc, dt[t], W["A"], B[t], C[t], W["D"], gate[t])
    rows, at, lengths = chunks_of
    xc = ops.conv_prefill(meta, layer, rows, x[at], lengths, W["weight"], W["bias"], keep)
    out = ops.prefill(meta, layer, rows, xc, dt[at], W["A"], B[at], C[at], lengths, keep)
    return (out + xc.float() * W["D"]) * torch.nn.functional.silu(gate[at])


def _mamba2(ops, meta, layer, inputs, rows_of, chunks_of, keep):
    """A Mamba-2 mixer's calls: conv over x, B and C, then the SSD update."""
    xbc, dt = inputs
    heads, head_dim, groups, state = W["heads"], W["head_dim"], W["groups"], W["state"]
    split = [heads * head_dim, groups * state, groups * state]
    if rows_of is not None:
        t = rows_of
        x, B, C = ops.conv_step(meta, layer, xbc[t], W["weight2"], W["bias2"]).split(split, -1)
        y = ops.step(meta, layer, x.reshape(-1, heads, head_dim), dt[t], W["A2"], B.reshape(-1, groups, state),
                         C.reshape(-1, groups, state), W["D2"])
        return y.reshape(y.shape[0], -1)
    rows, at, lengths = chunks_of
    r, n = at.shape
    x, B, C = ops.conv_prefill(meta, layer, rows, xbc[at], lengths, W["weight2"], W["bias2"], keep).split(split, -1)
    y = ops.prefill(meta, layer, rows, x.reshape(r, n, heads, head_dim), dt[at], W["A2"],
                        B.reshape(r, n, groups, state), C.reshape(r, n, groups, state), W["D2"], lengths, keep)
    return y.reshape(r, n, -1)


def _short_conv(ops, meta, layer, inputs, rows_of, chunks_of, keep):
    """A gated short convolution's calls (LFM2)."""
    b, c, x = inputs
    if rows_of is not None:
        t = rows_of
        return ops.step(meta, layer, b[t], c[t], x[t], W["weight3"], W["bias"])
    rows, at, lengths = chunks_of
    return ops.prefill(meta, layer, rows, b[at], c[at], x[at], lengths, W["weight3"], W["bias"], keep)


def _gated_delta(ops, meta, layer, inputs, rows_of, chunks_of, keep):
    """A Gated DeltaNet mixer's calls: conv over q, k and v, then the gated
    delta rule on L2-normalised q and k."""
    qkv, g, beta = inputs
    k_heads, v_heads, k_dim, v_dim = W["k_heads"], W["v_heads"], W["k_dim"], W["v_dim"]

    def heads(x):
        q, k, v = x.split([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], -1)
        q, k = (torch.nn.functional.normalize(t.unflatten(-1, (k_heads, k_dim)), dim=-1) for t in (q, k))
        return q * k_dim ** -0.5, k, v.unflatten(-1, (v_heads, v_dim))

    if rows_of is not None:
        t = rows_of
        q, k, v = heads(ops.conv_step(meta, layer, qkv[t], W["weight4"], None))
        return ops.step(meta, layer, q, k, v, g[t], beta[t]).flatten(1)
    rows, at, lengths = chunks_of
    q, k, v = heads(ops.conv_prefill(meta, layer, rows, qkv[at], lengths, W["weight4"], None, keep))
    return ops.prefill(meta, layer, rows, q, k, v, g[at], beta[at], lengths, keep).flatten(2)


_g = torch.Generator().manual_seed(0)
W = dict(A=-torch.rand(24, 8, generator=_g) - 0.1, D=torch.randn(24, generator=_g),
         weight=torch.randn(24, 4, generator=_g), bias=torch.randn(24, generator=_g),
         heads=4, head_dim=6, groups=2, state=8, A2=-torch.rand(4, generator=_g) - 0.1, D2=torch.randn(4, generator=_g),
         weight2=torch.randn(56, 4, generator=_g), bias2=torch.randn(56, generator=_g),
         weight3=torch.randn(24, 3, generator=_g),
         k_heads=2, v_heads=4, k_dim=4, v_dim=3, weight4=torch.randn(28, 4, generator=_g))
# kind -> (state shapes, per-token input widths, the mixer's calls, output width)
KINDS = {
    "mamba": (((24, 3), (24, 8)), (24, 24, 8, 8, 24), _mamba, 24),
    "mamba2": (((56, 3), (4, 6, 8)), (56, 4), _mamba2, 24),
    "short_conv": (((24, 2),), (24, 24, 24), _short_conv, 24),
    "gated_delta": (((28, 3), (4, 4, 3)), (28, 4, 4), _gated_delta, 12),
}


class RecurrentCase:
    """A recurrent layer's states in a pool (two layers share each block),
    the step's sequences reading their states from read pages (or the zero
    state) and writing to write pages; every page no one reads NaN, the
    null page zero. `kind` picks the mixer whose ops the layers call."""

    def __init__(self, step, verifying=None, seed=0, kind="mamba"):
        gen = torch.Generator().manual_seed(seed)
        shapes, widths, self.mixer, self.width = KINDS[kind]
        self.kind = kind
        spec = RecurrentSpec(shapes=shapes, dtypes=("float32",) * len(shapes), kind=kind)
        self.layout = plan_layout({"layers.0": spec, "layers.1": spec}, memory_bytes=1 << 20, block_size=4)
        self.buffers = KVBuffers(self.layout)
        group = self.layout.groups[0]
        per = group.pages_per_block
        self.step = step
        n = len(step)
        pages = torch.randperm(self.layout.num_pages - 1, generator=gen)[:2 * n * per] + 1
        self.read = pages[:n * per].view(n, per).clone()
        self.write = pages[n * per:].view(n, per).clone()
        self.zero = torch.tensor([cached == 0 for cached, _ in step])
        self.read[self.zero] = 0
        self.buffers.pool.view(torch.uint8).fill_(255)  # NaN float32 bytes
        self.buffers.pool[0] = 0
        states = torch.randn(n, per * self.layout.page_size_bytes // 4, generator=gen) * 0.5
        for r in range(n):
            if not self.zero[r]:
                self.buffers.pool[self.read[r]] = states[r].view(torch.uint8).view(per, -1)
        tokens = sum(c for _, c in step)
        self.inputs = StepInputs.from_host(np.zeros(tokens, dtype=np.int64), np.array([c for c, _ in step]),
                                           np.array([c for _, c in step]), np.arange(n), "cpu", verifying)
        # Each sequence's token inputs depend on the sequence and the token
        # only, so a shorter step sees the same first tokens.
        rows = []
        for r, (_, count) in enumerate(step):
            g = torch.Generator().manual_seed(1000 * seed + r)
            rows.append([torch.randn(16, size, generator=g)[:count] for size in widths])
        self.token_inputs = [torch.cat(parts) for parts in zip(*rows)]
        if kind == "mamba":  # dt after softplus
            self.token_inputs[1] = torch.nn.functional.softplus(self.token_inputs[1])
        if kind == "mamba2":
            self.token_inputs[1] = torch.nn.functional.softplus(self.token_inputs[1])
        if kind == "gated_delta":  # log decays g <= 0, write strengths beta in (0, 1)
            self.token_inputs[1] = -torch.nn.functional.softplus(self.token_inputs[1])
            self.token_inputs[2] = torch.sigmoid(self.token_inputs[2])

    def run(self, backend, accepted=None):
        """Both layers through `backend`'s ops for the kind, as the kind's mixer calls them: outputs
        [tokens, width] per layer, and the pool after `finish` (and
        `keep_accepted` where drafts were verified)."""
        pool_before = self.buffers.pool.clone()
        ops = backend.recurrent[self.kind]
        meta = ops.build(self.inputs, self.buffers, self.read, self.write, self.zero)
        assert isinstance(meta, ops.metadata_type)  # the kind's own metadata
        outs = []
        tokens = self.token_inputs[0].shape[0]
        for layer in ("layers.0", "layers.1"):
            y = torch.zeros(tokens, self.width)
            if meta.num_steps:
                y[meta.step_tokens] = self.mixer(ops, meta, layer, self.token_inputs, meta.step_tokens, None, False)
            for chunks, keep in ((meta.prefills, False), ([v[:3] for v in meta.verifies], True)):
                if not chunks:
                    continue
                # All of a kind in one call, side by side, padded (as a mixer does; with `keep`
                # the verified chunks in meta.verifies order).
                rows = torch.tensor([row for row, _, _ in chunks])
                lengths = torch.tensor([count for _, _, count in chunks])
                at = torch.stack([start + torch.arange(int(lengths.max())).clamp(max=count - 1)
                                  for _, start, count in chunks])
                full = self.mixer(ops, meta, layer, self.token_inputs, None, (rows, at, lengths), keep)
                for i, (_, start, count) in enumerate(chunks):
                    y[start:start + count] = full[i, :count]
            outs.append(y)
        ops.finish(meta)
        if meta.verifies:
            ops.keep_accepted(meta, accepted)
        pool = self.buffers.pool.clone()
        self.buffers.pool.copy_(pool_before)
        return outs, pool


RECURRENT_STEPS = {"decodes": [(5, 1), (0, 1), (12, 1)], "mixed": [(0, 7), (9, 1), (4, 5), (0, 1)]}


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flashinfer"])
@pytest.mark.parametrize("shape", list(RECURRENT_STEPS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_recurrent_states_equal_the_reference(name, shape, kind):
    case = RecurrentCase(RECURRENT_STEPS[shape], kind=kind)
    expected, expected_pool = case.run(ReferenceBackend())
    got, pool = case.run(backend(name))
    for g, e in zip(got, expected):
        assert not g.isnan().any()
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    written = case.write.reshape(-1)
    torch.testing.assert_close(pool[written].view(torch.float32), expected_pool[written].view(torch.float32),
                               atol=1e-4, rtol=1e-4)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[written] = False
    assert torch.equal(pool[others], expected_pool[others])  # nothing but the write pages changed


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flashinfer"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rollback_keeps_the_state_after_the_last_accepted_draft(name, kind):
    # Two sequences verify drafts (4 and 3 tokens); keeping 1 and 2 of them
    # must leave what a plain run of the accepted tokens leaves.
    step = [(6, 4), (3, 3), (8, 1)]
    verifying = np.array([True, True, False])
    case = RecurrentCase(step, verifying, seed=5, kind=kind)
    _, pool = case.run(backend(name), accepted=[1, 2])
    shorter = RecurrentCase([(6, 2), (3, 3), (8, 1)], seed=5, kind=kind)
    _, expected = shorter.run(ReferenceBackend())
    for r in range(2):
        pages = case.write[r]
        torch.testing.assert_close(pool[pages].view(torch.float32), expected[pages].view(torch.float32),
                                   atol=1e-4, rtol=1e-4)


def test_the_reference_prefill_of_every_kind_equals_its_steps():
    # The reference itself: a chunk prefilled in one call leaves the state
    # and outputs of the same tokens fed one decode step at a time (for
    # Mamba-2 and Gated DeltaNet the chunked scans against their recurrences).
    for kind in KINDS:
        whole = RecurrentCase([(5, 9)], kind=kind, seed=2)
        outs, pool = whole.run(ReferenceBackend())
        case = RecurrentCase([(5, 1)], kind=kind, seed=2)
        ops = ReferenceBackend().recurrent[kind]
        steps = []
        buffers = case.buffers
        before = buffers.pool.clone()
        read = case.read
        for t in range(9):
            inputs = StepInputs.from_host(np.zeros(1, dtype=np.int64), np.array([5 + t]), np.array([1]),
                                          np.arange(1), "cpu")
            meta = ops.build(inputs, buffers, read, case.write, case.zero)
            token = [part[t:t + 1] for part in whole.token_inputs]
            steps.append(case.mixer(ops, meta, "layers.0", token, torch.tensor([0]), None, False))
            case.mixer(ops, meta, "layers.1", token, torch.tensor([0]), None, False)
            ops.finish(meta)
            read = case.write
        torch.testing.assert_close(torch.cat(steps), outs[0], atol=1e-4, rtol=1e-4)
        written = case.write.reshape(-1)
        torch.testing.assert_close(buffers.pool[written].view(torch.float32), pool[written].view(torch.float32),
                                   atol=1e-4, rtol=1e-4)
        buffers.pool.copy_(before)


def test_the_gated_delta_chunked_scan_equals_its_recurrence_across_chunks():
    # Chunks of 4 tokens: requests of 11, 8 and 3 tokens side by side cross
    # chunk boundaries, end on one and inside one, and pass padding through;
    # decays from near 1 to strong, two value heads per key head.
    from hybridkv.layers.gated_delta_ops import gated_delta_scan

    gen = torch.Generator().manual_seed(7)
    r, n, k_heads, v_heads, k_dim, v_dim = 3, 11, 2, 4, 5, 3
    q, k = (torch.nn.functional.normalize(torch.randn(r, n, k_heads, k_dim, generator=gen), dim=-1) for _ in "qk")
    v = torch.randn(r, n, v_heads, v_dim, generator=gen)
    g = -torch.rand(r, n, v_heads, generator=gen) * torch.tensor([0.05, 0.5, 2.0, 6.0])
    beta = torch.rand(r, n, v_heads, generator=gen)
    state = torch.randn(r, v_heads, k_dim, v_dim, generator=gen)
    lengths = torch.tensor([11, 8, 3])
    chunked, final, _ = gated_delta_scan(q, k, v, g, beta, state, lengths, chunk=4)
    stepped, _, every = gated_delta_scan(q, k, v, g, beta, state, lengths, per_token=True)
    for i, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(chunked[i, :length], stepped[i, :length], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[i], every[i, length - 1], atol=1e-5, rtol=1e-5)


def test_a_backend_without_kernels_for_a_kind_says_so_in_its_prepare_report():
    # Declared, not probed: a backend names the recurrent kinds it steps its
    # own way; the layers of any other kind get the reference's ops on
    # gathered states, and the report says which.
    from types import SimpleNamespace

    specs = {f"model.layers.{i}": RecurrentSpec(shapes, ("float32",) * len(shapes), kind=kind)
             for i, (kind, (shapes, *_)) in enumerate(KINDS.items())}
    layout = plan_layout(specs, memory_bytes=1 << 20, block_size=4)
    layers = {name: SimpleNamespace() for name in specs}
    model = SimpleNamespace(cache_layers=lambda: layers)
    for name in BACKENDS:
        if name == "flashinfer":
            continue
        b = backend(name)
        report = PrepareReport(b.name)
        b.bind_ops(model, layout, report)
        missing = sorted(set(KINDS) - b.capabilities.recurrent_kinds)
        assert sorted(k for k in KINDS if any(f"for {k} layers" in d for d in report.declined)) == missing, report
        if name == "triton":
            assert missing == ["short_conv"]
        else:
            assert missing == []


def test_each_recurrent_kind_has_one_contract_that_every_backend_binds():
    # One ops class (and one metadata) per kind; a backend's ops for a kind
    # are of that kind's class, whoever's kernels run them.
    from hybridkv.core import RECURRENT_KINDS
    from hybridkv.layers.backends.base import RECURRENT_OPS

    assert tuple(RECURRENT_OPS) == RECURRENT_KINDS
    for name in BACKENDS:
        if name == "flashinfer":
            continue
        b = backend(name)
        assert sorted(b.recurrent) == sorted(RECURRENT_KINDS)
        assert all(isinstance(b.recurrent[kind], RECURRENT_OPS[kind]) for kind in RECURRENT_KINDS)


def test_every_backend_that_should_run_here_runs():
    # The suite's parameters come from what imports; the cpu backend must
    # be among them wherever a compiler is (a skip here would hide it).
    from hybridkv.layers.backends.cpu import build

    if build.compiler() is not None:
        assert backend("cpu").name == "cpu"
    assert "torch" in BACKENDS
