"""A tensor-parallel step plan as one int64 array (engine/plan_wire.py):
what the driver encodes, a worker decodes to the same plan, sequences by
their place in it."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import FullAttentionSpec, MambaSpec, plan_layout
from hybridkv.core.tiers import BlockLoad, BlockStore, TierPlan
from hybridkv.engine import plan_wire
from hybridkv.engine.step_plan import StepPlan


@pytest.fixture(scope="module")
def layout():
    specs = {"a": FullAttentionSpec(num_kv_heads=2, head_size=8, dtype="float32"),
             "m": MambaSpec(shapes=((64, 3), (64, 16)), dtypes=("float32", "float32"))}
    return plan_layout(specs, "4MiB", block_size=4)


def plan(layout, verifying: bool, accepted):
    attention = next(g for g in layout.groups if not g.recurrent)
    mamba = next(g for g in layout.groups if g.recurrent)
    aw, mw = attention.pages_per_block, mamba.pages_per_block
    pages = np.arange(3 * aw, dtype=np.int64).reshape(aw, 3)
    changes = [(attention.index, np.array([3, 3, 0]), np.array([0, 2, 1]), pages),
               (mamba.index, np.array([1, 4]), np.arange(2 * mw, dtype=np.int64).reshape(2, mw) + 5,
                np.arange(2 * mw, dtype=np.int64).reshape(2, mw) + 9, np.array([True, False]))]
    return StepPlan(ids=np.array([5, 6, 7, 8, 9], dtype=np.int64), first_positions=np.array([0, 12], dtype=np.int64),
                    counts=np.array([4, 1], dtype=np.int64), rows=np.array([3, 1], dtype=np.int64),
                    verifying=np.array([False, True]) if verifying else None,
                    sampled=np.array([3, 4], dtype=np.int64), copies=[(4, 7), (5, 8)],
                    table_changes=changes, accepted=accepted,
                    tiers=TierPlan([BlockStore(0, b"\x01" * 32, (4, 5)), BlockStore(1, b"abc", (6,))],
                                   [BlockLoad("", 0, b"k" * 9, (7, 8))], clear=True))


@pytest.mark.parametrize("verifying, accepted", [(False, None), (True, {}), (True, {0: 2, 1: 0})])
def test_a_plan_travels_whole(layout, verifying, accepted):
    sent = plan(layout, verifying, accepted)
    data = plan_wire.encode(sent)
    assert data.dtype == np.int64 and data.ndim == 1
    got = plan_wire.decode(data, layout)
    for name in ("ids", "first_positions", "counts", "rows", "sampled"):
        assert np.array_equal(getattr(got, name), getattr(sent, name)), name
    assert (got.verifying is None) == (sent.verifying is None)
    if verifying:
        assert got.verifying.tolist() == sent.verifying.tolist()
    assert got.copies == sent.copies and got.accepted == sent.accepted and got.tiers == sent.tiers
    assert len(got.table_changes) == 2
    for a, b in zip(got.table_changes, sent.table_changes):
        assert a[0] == b[0]
        for x, y in zip(a[1:], b[1:]):
            assert np.array_equal(np.asarray(x), np.asarray(y))


def test_a_plan_of_another_format_is_an_error(layout):
    data = plan_wire.encode(plan(layout, False, None))
    with pytest.raises(ValueError, match="ranks disagree"):
        plan_wire.decode(np.concatenate([data, [0]]), layout)


def test_tier_copies_travel_alone():
    # A flush's stores (straight to disk), or a reset's clear, outside a step.
    tiers = TierPlan([BlockStore(1, b"\x02" * 32, (3,)), BlockStore(0, b"w" * 32, (7, 8))], flush=True)
    data = plan_wire.encode_tiers(tiers)
    assert data.dtype == np.int64 and plan_wire.decode_tiers(data) == tiers
    assert plan_wire.decode_tiers(plan_wire.encode_tiers(TierPlan(clear=True))) == TierPlan(clear=True)
    with pytest.raises(ValueError, match="ranks disagree"):
        plan_wire.decode_tiers(np.concatenate([data, [0]]))
