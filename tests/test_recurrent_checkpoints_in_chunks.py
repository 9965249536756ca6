"""A recurrent mixer writes its state at a checkpoint inside a prefill chunk
(docs/architecture.md): the chunk runs in pieces cut at its checkpoints, each
piece the computation a chunk ending there would run, and the state after
it is copied to the checkpoint's pages. So a prompt that needs a
checkpoint before its end is one engine step of prefill, and:

* the states saved inside a chunk are, bit for bit in float32, the states a
  chunk stopping at the same positions leaves (the engine of a backend that
  declares `checkpoints_inside_chunks` False, which cuts its chunks there),
  for Mamba-1 (Jamba), Mamba-2 (Nemotron-H), Gated DeltaNet (Qwen3-Next)
  and the short conv (LFM2), on the reference, C and Triton backends;
* a prefix hit at such a checkpoint gives transformers' tokens;
* the manager caches exactly the checkpoints a pass wrote, and lets go of
  the blocks of those it did not reach (preemption, abort)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.engine.plan_wire import decode, encode
from hybridkv.core import RecurrentSpec, plan_layout
from hybridkv.engine.step_plan import StepPlan
from hybridkv.layers.kv_buffers import KVBuffers
from hybridkv.layers.step import StepInputs
from kv_shadow import FULL, MAMBA, manager
from oracle import check_tokens, load_reference, model_dir, record_logits

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LOGIT_TOL = 2e-5  # tighter than tests/test_recurrent_families.py: a state saved at the wrong place shows
FAMILIES = ("jamba", "nemotron_h", "qwen3_next", "lfm2")  # Mamba-1, Mamba-2, Gated DeltaNet, short conv
_built: dict = {}


def _model(family, tmp_path_factory):
    if family not in _built:
        path = model_dir(tmp_path_factory, family)
        _built[family] = path, load_reference(path)
    return _built[family]


def _backend_class(name):
    if name == "torch":
        from hybridkv.layers.backends.reference import ReferenceBackend
        return ReferenceBackend
    if name == "cpu":
        from hybridkv.layers.backends.cpu import CpuBackend
        return CpuBackend
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    from hybridkv.layers.backends.triton import TritonBackend
    return TritonBackend


def make_engine(path, backend="torch", **kw):
    options = dict(kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=512, backend=backend)
    options.update(kw)
    return Engine(path, **options)


def cutting_engine(path, backend, monkeypatch, **kw):
    """An engine whose backend declares it cannot save states inside a
    chunk: its chunks end at every checkpoint."""
    cls = _backend_class(backend)
    monkeypatch.setattr(cls, "capabilities", dataclasses.replace(cls.capabilities, checkpoints_inside_chunks=False))
    engine = make_engine(path, backend, **kw)
    monkeypatch.undo()
    return engine


def prompt_of(n, start=3):
    return [(start + 3 * j) % 200 + 3 for j in range(n)]


def recurrent_checkpoints(engine) -> dict:
    """Every cached recurrent state, by group and key: its pages' bytes."""
    pool = engine.worker.buffers.pool
    out = {}
    for group in engine.layout.groups:
        if group.recurrent:
            for key, pages in engine.kv.cached_pages(group.index):
                out[group.index, key] = pool[torch.tensor(list(pages))].clone()
    return out


def op_states(ops, kind, token_inputs, bounds, offsets=()):
    """One recurrent layer of `kind` (the conformance suite's mixer calls,
    tests/test_backend_conformance.py) through `ops` on the rows of
    `token_inputs`, as prefill chunks [bounds[i], bounds[i + 1]) one step
    after the other, the first from the zero state, each from the state
    the one before left; the last saves the states after `offsets` of its
    tokens on its way, pass by pass as a model's mixer runs them. Returns
    the state after each chunk and after each offset (float32 parts)."""
    from test_backend_conformance import KINDS

    shapes, _, mixer, _ = KINDS[kind]
    spec = RecurrentSpec(shapes=shapes, dtypes=("float32",) * len(shapes), kind=kind)
    layout = plan_layout({"layers.0": spec}, memory_bytes=1 << 20, block_size=4)
    buffers = KVBuffers(layout)
    width = layout.groups[0].pages_per_block
    chunks = list(zip(bounds, bounds[1:]))
    blocks = [tuple(range(1 + width * k, 1 + width * (k + 1))) for k in range(len(chunks) + len(offsets))]
    read = torch.zeros(1, width, dtype=torch.int64)
    for k, (start, end) in enumerate(chunks):
        count = end - start
        inputs = StepInputs.from_host(np.zeros(count, dtype=np.int64), np.array([start]), np.array([count]),
                                      np.array([0]), "cpu")
        saves = [(0, o, pages) for o, pages in zip(offsets, blocks[len(chunks):])] if k == len(chunks) - 1 else []
        meta = ops.build(inputs, buffers, read, torch.tensor([blocks[k]]), torch.tensor([k == 0]), saves=saves)
        rows_inputs = [t[start:end] for t in token_inputs]
        for pieces, keep, copies in meta.passes:
            rows = torch.tensor([row for row, _, _ in pieces])
            lengths = torch.tensor([n for _, _, n in pieces])
            at = torch.stack([first + torch.arange(int(lengths.max())).clamp(max=n - 1) for _, first, n in pieces])
            mixer(ops, meta, "layers.0", rows_inputs, None, (rows, at, lengths), keep)
            if copies is not None:
                ops.save_states(meta, "layers.0", copies)
        ops.finish(meta)
        read = torch.tensor([blocks[k]])
    states = [[part[0].clone() for part in buffers.state_views(buffers.pool[torch.tensor(pages)].reshape(1, -1),
                                                                 "layers.0")] for pages in blocks]
    return states[:len(chunks)], states[len(chunks):]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("kind", ["mamba", "mamba2", "gated_delta", "short_conv"])
def test_hybrid_a_state_saved_inside_a_chunk_is_bit_for_bit_the_one_a_chunk_stopping_there_leaves(kind, backend):
    # On the same token inputs: after a chunk of 3 tokens, one chunk of 70
    # tokens (past the SSD and gated delta scans' 64-token chunks) saving
    # the states after 4, 13 and 68 of them, against chunks that stop
    # there, each going on from the state the one before left: [3, 7),
    # [7, 16), [16, 71). Bit for bit: the same computation.
    from test_backend_conformance import KINDS, backend as make_backend

    _backend_class(backend)  # (skips triton where it is not installed)
    ops = make_backend(backend).recurrent[kind]
    g = torch.Generator().manual_seed(1)
    widths = KINDS[kind][1]
    token_inputs = [torch.randn(73, w, generator=g) for w in widths]
    if kind in ("mamba", "mamba2"):  # dt after softplus
        token_inputs[1] = torch.nn.functional.softplus(token_inputs[1])
    if kind == "gated_delta":  # log decays g <= 0, write strengths beta in (0, 1)
        token_inputs[1] = -torch.nn.functional.softplus(token_inputs[1])
        token_inputs[2] = torch.sigmoid(token_inputs[2])
    offsets = (4, 13, 68)
    _, saved = op_states(ops, kind, token_inputs, (0, 3, 73), offsets)
    expected, _ = op_states(ops, kind, token_inputs, (0, 3) + tuple(3 + o for o in offsets))
    for offset, state, want in zip(offsets, saved, expected[1:]):
        for part, (got, wanted) in enumerate(zip(state, want)):
            assert torch.equal(got, wanted), \
                f"part {part} after {offset} tokens: max |diff| {(got - wanted).abs().max().item()}"


# Triton's engine run (under its interpreter here, slow) takes Jamba, whose
# Mamba-1 scan is Triton's own kernel; the other kinds' Triton states are
# the shared gather path, held bit for bit by the ops case above.
@pytest.mark.parametrize("family, backend", [(f, b) for f in FAMILIES for b in ("torch", "cpu")] + [("jamba", "triton")])
def test_hybrid_states_saved_inside_a_chunk_equal_those_of_chunks_stopping_there(family, backend, tmp_path_factory,
                                                                                 monkeypatch):
    # Checkpoints at every block boundary (the "every_block" policy): one
    # chunk of 30 tokens saves 7 states on its way; the cutting engine
    # computes the same prompt in 8 chunks, each ending at one of them. The
    # states agree to float32 rounding (not bit for bit: the attention and
    # MoE layers between the recurrent ones run on 30 rows here and on
    # fewer there; the mixer's own computation is the same, checked above).
    path, reference = _model(family, tmp_path_factory)
    _backend_class(backend)
    prompt = prompt_of(30)
    inside = make_engine(path, backend, checkpoint_policy="every_block")
    out = inside.generate([prompt], ONE, use_tqdm=False)[0]
    assert inside.num_steps == 1
    cutting = cutting_engine(path, backend, monkeypatch, checkpoint_policy="every_block")
    assert any("inside prefill chunks" in line for line in cutting.stats["backend"]["declined"])
    again = cutting.generate([prompt], ONE, use_tqdm=False)[0]
    assert cutting.num_steps == 8
    assert out.outputs[0].token_ids == again.outputs[0].token_ids
    check_tokens(reference, prompt, out.outputs[0].token_ids)
    saved, expected = recurrent_checkpoints(inside), recurrent_checkpoints(cutting)
    groups = sum(g.recurrent for g in inside.layout.groups)
    assert len(saved) == len(expected) == 7 * groups  # (4, 8, ..., 28 in each recurrent group)
    assert saved.keys() == expected.keys()
    buffers = inside.worker.buffers
    for (g, key), pages in expected.items():
        for name in inside.layout.groups[g].layer_names:
            got = buffers.state_views(saved[g, key].reshape(1, -1), name)
            want = buffers.state_views(pages.reshape(1, -1), name)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for engine in (inside, cutting):
        assert engine.kv.num_free_pages == engine.kv.num_total_pages


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_prefix_hits_at_checkpoints_saved_inside_a_chunk_give_transformers_tokens(family, tmp_path_factory):
    # The first prompt is one chunk with its prompt-end checkpoint (28)
    # inside; a second prompt sharing 28 tokens hits there, then runs from
    # the saved state: transformers' tokens.
    # Every logits row is transformers' (a state saved at the wrong place
    # shows there even where the argmax survives it).
    path, reference = _model(family, tmp_path_factory)
    engine = make_engine(path)
    records = record_logits(engine)
    first = prompt_of(30)
    out1 = engine.generate([first], GREEDY, use_tqdm=False)[0]
    assert engine.num_steps == GREEDY.max_tokens  # one prefill step, then decodes
    second = first[:28] + [7, 11, 13, 17, 19]
    out2 = engine.generate([second], GREEDY, use_tqdm=False)[0]
    assert out2.metrics.num_cached_tokens == 28
    for prompt, out in ((first, out1), (second, out2)):
        expected = check_tokens(reference, prompt, out.outputs[0].token_ids)
        rows = [(position, row) for seq_id, position, row in records if seq_id == out.request_id]
        assert len(rows) == GREEDY.max_tokens
        assert max((row - expected[position]).abs().max().item() for position, row in rows) < LOGIT_TOL
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_hybrid_a_prompt_needing_a_checkpoint_is_one_prefill_step(tmp_path_factory, monkeypatch):
    path, reference = _model("jamba", tmp_path_factory)
    prompt = prompt_of(30)  # its prompt-end checkpoint, 28, lies before its end
    engine = make_engine(path)
    out = engine.generate([prompt], ONE, use_tqdm=False)[0]
    assert engine.num_steps == 1
    cutting = cutting_engine(path, "torch", monkeypatch)
    assert cutting.generate([prompt], ONE, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert cutting.num_steps == 2  # the chunk ends at 28, then 2 tokens more
    # A budget shorter than the prompt still cuts by the budget alone.
    small = make_engine(path, max_num_batched_tokens=16)
    assert small.generate([prompt], ONE, use_tqdm=False)[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert small.num_steps == 2


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_hybrid_the_same_prompt_twice_hits_on_the_second_send(family, tmp_path_factory):
    # At the default block size of a model with recurrent layers (64): a
    # prompt of 150 tokens computes in one step and leaves its checkpoint
    # at 128, inside the chunk; the second send hits there.
    path, reference = _model(family, tmp_path_factory)
    engine = Engine(path, kv_cache_memory="32MiB", progress=False, max_model_len=512)
    assert engine.layout.block_size == 64
    prompt = prompt_of(150)
    first = engine.generate([prompt], ONE, use_tqdm=False)[0]
    assert engine.num_steps == 1
    second = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens == 128
    assert second.outputs[0].token_ids[:1] == first.outputs[0].token_ids
    check_tokens(reference, prompt, second.outputs[0].token_ids)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


# -- the manager's bookkeeping --------------------------------------------------
def test_hybrid_marking_a_chunk_computed_caches_the_checkpoints_inside_it():
    kv = manager({"a": FULL, "m": MAMBA}, pages=64, checkpoint_policy="every_block", checkpoints_inside_chunks=True)
    prompt = list(range(1, 15))
    kv.add_request("r", prompt)
    chunk = kv.next_chunk("r", 100)
    assert chunk == 14  # not cut at 4, 8 or 12
    assert kv.allocate_slots("r", chunk)
    saving = kv.get_checkpoint_pages("r")[1]
    assert [position for position, _ in saving] == [4, 8, 12]
    kv.check_invariants()
    kv.mark_computed("r", chunk)
    assert kv.get_checkpoint_pages("r") == {}
    kv.check_invariants()
    for n in (5, 9, 13):  # each hits the checkpoint below it
        kv.add_request("p", prompt[:n])
        assert kv.get_computed_tokens("p") == n - 1
        kv.free("p")
    kv.free("r")
    assert kv.num_free_pages == kv.num_total_pages


def test_hybrid_checkpoints_a_pass_did_not_reach_are_never_cached():
    # Allocated, then freed before the pass (preemption, abort): the blocks
    # go back unread and no checkpoint is cached.
    kv = manager({"a": FULL, "m": MAMBA}, pages=64, checkpoint_policy="every_block", checkpoints_inside_chunks=True)
    prompt = list(range(1, 15))
    kv.add_request("r", prompt)
    assert kv.allocate_slots("r", kv.next_chunk("r", 100))
    kv.free("r")
    kv.check_invariants()
    assert kv.num_free_pages == kv.num_total_pages
    assert kv.cached_keys(1) == []


def test_hybrid_a_full_pool_cuts_the_chunk_at_the_checkpoint_instead():
    # No page to spare for a state inside the chunk: it ends at the
    # checkpoint, as a backend that cannot save inside would have it.
    kv = manager({"a": FULL, "m": MAMBA}, pages=6, checkpoints_inside_chunks=True)  # 5 usable: the chunk's own 5
    kv.add_request("r", list(range(1, 15)))  # prompt-end checkpoint at 12
    assert kv.next_chunk("r", 100) == 12
    roomy = manager({"a": FULL, "m": MAMBA}, pages=64, checkpoints_inside_chunks=True)
    roomy.add_request("r", list(range(1, 15)))
    assert roomy.next_chunk("r", 100) == 14


def test_hybrid_checkpoint_saves_travel_in_the_plan_wire():
    from kv_shadow import layout_with_pages

    layout = layout_with_pages({"a": FULL, "m": MAMBA}, 64, 4)
    width = layout.groups[1].pages_per_block
    plan = StepPlan(np.arange(5), np.array([0]), np.array([5]), np.array([0]), None, np.array([4]))
    plan.checkpoint_saves = [(0, 4, 1, tuple(range(3, 3 + width)))]
    back = decode(encode(plan), layout)
    assert back.checkpoint_saves == plan.checkpoint_saves

