"""The tensor-parallel all-reduce through shared memory (engine/host_reduce.py,
kernels.c `host_all_reduce`), its protocol exercised by threads standing for
the ranks (the C call lets go of the GIL), each with its own map of one
segment: every rank gets the same sum, in float32 and bfloat16 (rounded
once), of any size (several slots' worth in parts, none at all); a rank
that never comes makes the others give up, at the abort word or after the
timeout, with an error. Two real processes: tests/test_tensor_parallel*.py."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridkv.engine.host_reduce import SLOT_BYTES, create_segment, open_host_reduce


@pytest.fixture
def ranks(tmp_path):
    path = str(tmp_path / "segment")

    def make(world, timeout=30.0):
        create_segment(path, world)
        reducers = [open_host_reduce(path, rank, world, timeout) for rank in range(world)]
        if reducers[0] is None:
            pytest.skip("the C kernels are not built here")
        return reducers
    return make


def run_ranks(reducers, tensors):
    """Each rank reduces its tensors, in order, on a thread of its own."""
    errors = []

    def rank(r):
        try:
            for x in tensors[r]:
                assert reducers[r](x)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(reducers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_same_sum_of_any_size(ranks, world):
    reducers = ranks(world)
    gen = torch.Generator().manual_seed(0)
    sizes = [5, 0, 64 * 1024, SLOT_BYTES // 4 * 2 + 17, 1]  # one of them three slots' worth
    inputs = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(world)]
    bf16 = [[torch.randn(n, generator=gen).bfloat16() for n in (33, SLOT_BYTES // 2 + 3)] for _ in range(world)]
    tensors = [[x.clone() for x in inputs[r] + bf16[r]] for r in range(world)]
    run_ranks(reducers, tensors)
    for i in range(len(sizes)):
        expected = inputs[0][i].clone()
        for r in range(1, world):
            expected += inputs[r][i]
        for r in range(world):
            assert torch.equal(tensors[r][i], expected), (world, sizes[i], r)
    for j in range(2):
        exact = sum(bf16[r][j].float() for r in range(world))
        for r in range(world):
            assert torch.equal(tensors[r][len(sizes) + j], exact.bfloat16())
    assert len({red.parts for red in reducers}) == 1  # the same count of parts on every rank


def test_tensors_it_does_not_take_go_to_the_collective_it_replaces(ranks):
    (reducer, _) = ranks(2)
    assert not reducer(torch.ones(4, dtype=torch.float64))
    assert not reducer(torch.ones(4, 2)[:, 0])  # not contiguous
    assert reducer.parts == 0


def test_a_rank_that_never_comes_is_an_error_not_a_hang(ranks):
    reducers = ranks(2, timeout=0.5)
    with pytest.raises(RuntimeError, match="no answer in 0 s|no answer in 1 s"):
        reducers[0](torch.ones(8))
    reducers = ranks(2)
    threading.Timer(0.2, reducers[1].abort).start()  # the watchdog, stopping the group
    with pytest.raises(RuntimeError, match="a rank stopped"):
        reducers[0](torch.ones(8))
