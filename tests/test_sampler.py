"""The batched sampler: greedy rows are the first maximum, a broken row
fails alone, filters keep only what they allow, and a seeded request's
tokens do not depend on the rest of the batch. The random streams
(seeding.py): every bit of a 64-bit seed counts, children of n > 1 have
streams of their own, unseeded requests draw fresh entropy per engine."""

import pytest
import torch

from hybridkv import SamplingParams
from hybridkv.engine.sampler import sample
from hybridkv.engine.seeding import engine_stream, pick, request_stream

GREEDY = SamplingParams(temperature=0.0)


def draw(logits, params, streams=None, seed=0, row_max=None):
    streams = streams or [None] * len(params)
    return sample(logits, params, streams, engine_stream(seed), row_max)


def row_maxes():
    """The greedy picks the sampler is given: torch's max, and the cpu
    backend's C one where its kernels are built."""
    from hybridkv.layers.backends.cpu import library

    lib = library.load()
    if lib is None:
        return [None]
    from hybridkv.layers.backends.cpu import CpuBackend

    return [None, CpuBackend().row_max]


# A bfloat16 model's logits come as its LM head wrote them (modeling/base.py).
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_max", row_maxes(), ids=lambda f: "torch" if f is None else "cpu")
def test_greedy_rows_take_the_first_maximum(row_max, dtype):
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]], dtype=dtype)
    assert draw(logits, [GREEDY, GREEDY], row_max=row_max) == [1, 0]
    wide = torch.zeros(3, 70_001)
    wide[0, 40_000] = wide[0, 60_000] = 2.0  # spans apart: the first still wins
    wide[1, 70_000] = 1.0
    wide[2, 16] = wide[2, 33] = -1.0
    wide[2] -= 5.0
    assert draw(wide.to(dtype), [GREEDY] * 3, row_max=row_max) == [40_000, 70_000, 0]


@pytest.mark.parametrize("row_max", row_maxes(), ids=lambda f: "torch" if f is None else "cpu")
def test_bfloat16_logits_sample_as_their_float32_values(row_max):
    """The same tokens from bfloat16 logits as from the same values in
    float32: greedy rows (values that differ in the last bfloat16 bit) and
    seeded draws (the rows drawn from are widened before the temperature)."""
    logits = torch.randn(4, 3_000, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[0, 2_999] = logits[0].max() + 0.0078125  # the largest, one step above the next
    hot = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    params = [GREEDY, hot, GREEDY, SamplingParams(temperature=1.3, seed=5)]
    streams = [None if p.seed is None else request_stream(p.seed, 0) for p in params]
    narrow = draw(logits, params, streams, row_max=row_max)
    streams = [None if p.seed is None else request_stream(p.seed, 0) for p in params]
    assert narrow == draw(logits.float(), params, streams, row_max=row_max)
    assert narrow[0] == 2_999


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row_max", row_maxes(), ids=lambda f: "torch" if f is None else "cpu")
def test_a_row_with_nan_or_inf_fails_alone(row_max, dtype):
    logits = torch.randn(3, 50)
    logits[0, 7] = float("nan")
    logits[2, 3] = float("inf")
    hot = SamplingParams(temperature=1.0)
    out = draw(logits.to(dtype), [GREEDY, hot, hot], row_max=row_max)
    assert out[0] is None and out[2] is None and isinstance(out[1], int)
    masked = torch.full((1, 10), float("-inf"))
    masked[0, 4] = 0.0  # -inf entries are ordinary masks
    assert draw(masked.to(dtype), [hot], row_max=row_max) == [4]
    assert draw(torch.full((1, 10), float("-inf"), dtype=dtype), [GREEDY], row_max=row_max) == [None]


def test_top_k_and_top_p_keep_only_what_they_allow():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 100, generator=gen)
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    params = SamplingParams(temperature=2.0, top_k=5)
    seen = {draw(logits, [params], seed=s)[0] for s in range(200)}
    assert seen <= top5 and len(seen) > 1
    assert {draw(logits, [SamplingParams(temperature=5.0, top_p=1e-6)], seed=s)[0] for s in range(20)} == \
        {int(logits.argmax())}
    assert {draw(logits, [SamplingParams(temperature=5.0, top_k=1)], seed=s)[0] for s in range(20)} == \
        {int(logits.argmax())}


def test_unfiltered_draws_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    counts = torch.bincount(torch.tensor(draw(logits, params)), minlength=4).float() / 4000
    assert torch.allclose(counts, torch.softmax(logits[0], -1), atol=0.03)


@pytest.mark.parametrize("filters", [{}, {"top_k": 20, "top_p": 0.9}])
def test_a_seeded_row_ignores_the_rest_of_the_batch(filters):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 300, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=11, **filters)

    def alone():
        return draw(logits[2:3], [seeded], [request_stream(11, 0)])[0]

    mixed = draw(logits, [SamplingParams(temperature=0.7), GREEDY, seeded, SamplingParams(temperature=1.3, top_k=3)],
                 [None, None, request_stream(11, 0), None], seed=5)
    assert mixed[2] == alone()


def test_pick_inverts_the_cumulative_distribution():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    uniforms = [0.0, 0.2499, 0.25, 0.9999, 1 - 1e-16]
    assert pick(probs, uniforms).tolist() == [1, 1, 3, 3, 3]  # never a column of probability 0
    assert pick(probs * 7, uniforms).tolist() == [1, 1, 3, 3, 3]  # unnormalised rows too


def draws(stream, n=8):
    return stream.random(n).tolist()


@pytest.mark.parametrize("seed", [0, 1, 12345, -1, 2**62 + 3, -(2**63)])
def test_every_bit_of_a_64_bit_seed_counts(seed):
    mine = draws(request_stream(seed, 0))
    assert mine == draws(request_stream(seed, 0))
    for k in (1, 2, 2**31 - 1):
        other = (seed + (k << 32) + 2**63) % 2**64 - 2**63  # seed + k * 2**32, wrapped into 64 bits
        assert draws(request_stream(other, 0)) != mine, k
    assert draws(request_stream(seed ^ (1 << 63), 0)) != mine  # the top bit too


def test_a_childs_stream_is_its_own():
    # Child i of seed s is neither seed s + i's stream nor another child's.
    seen = {}
    for seed in range(4):
        for index in range(4):
            seen[(seed, index)] = tuple(draws(request_stream(seed, index)))
    assert len(set(seen.values())) == len(seen)


def test_unseeded_draws_are_fresh_per_engine_unless_it_has_a_seed():
    assert draws(engine_stream(None)) != draws(engine_stream(None))
    assert draws(engine_stream(3)) == draws(engine_stream(3))
    assert draws(engine_stream(0)) != draws(request_stream(0, 0))  # an engine seed is no request's seed
