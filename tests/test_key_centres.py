"""Keys over int8 pages stored less their layer's centre
(layers/kv_quant.py KeyCentre, engine/key_centres.py): why attention is
left as it is, how a centre is measured, which layers take one, and that
the engine's calibration leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.layers.kv_quant import KeyCentre
from hybridkv.tiny_models import tiny_model_dir
from test_backend_conformance import MIXED, SPECS, AttentionCase, backend

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("spec", ["full", "window-5", "chunked-24"])
def test_keys_less_a_constant_leave_attention_as_it_is_unless_a_softcap_or_a_sink_sees_the_scores(spec):
    # Every score of a query moves by the same q.c: softmax does not see it.
    # A softcap (tanh of each score) and a sink (a logit the scores are
    # compared with) do, which is why those layers keep their keys.
    ops = backend("torch").attention
    case = AttentionCase(SPECS[spec], MIXED, torch.float32, seed=4)
    centre = torch.randn(case.k.shape[1:], generator=torch.Generator().manual_seed(9)) * 3.0
    shifted = AttentionCase(SPECS[spec], MIXED, torch.float32, seed=4)
    shifted.cache[:, 0] -= centre  # the cached keys (NaN where unread stays NaN)
    shifted.k = case.k - centre
    for softcap, sinks, same in ((None, None, True), (5.0, None, False), (None, case.sinks, False)):
        # (the reference reads masked slots too: finite garbage there, the same in both)
        plain = case.run(ops, 0.25, softcap, poison=False, sinks=sinks)[0]
        less = shifted.run(ops, 0.25, softcap, poison=False, sinks=sinks)[0]
        assert torch.allclose(plain, less, atol=1e-5) == same, (softcap, sinks)


def test_a_key_centre_is_the_mean_of_the_keys_it_measured_rounded_to_bfloat16():
    centre = KeyCentre(2, 8, "cpu")
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(7, 2, 8, generator=gen) + torch.linspace(-20, 20, 8)
    centre.measure(7)
    assert torch.equal(centre(keys[:4]), keys[:4])  # while measuring: stored as they are (the centre is zero)
    assert centre.measuring and not centre.values.any()
    centre(keys[4:])
    assert not centre.measuring
    expected = keys.double().mean(0).to(torch.bfloat16).float()
    assert torch.equal(centre.values, expected)
    assert torch.equal(centre(keys), keys - expected)
    centre.measure(2)
    with pytest.raises(RuntimeError, match="calibration prompt"):
        centre(keys[:3])  # more keys than it was told to measure: something else ran


def test_an_int8_engine_measures_its_centres_and_keeps_nothing_of_the_calibration():
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", kv_cache_dtype="int8", progress=False,
                    backend="cpu", dtype="float32", enable_kv_events=True)
    stats = engine.stats
    attention = [m for m in engine.model.cache_layers().values() if hasattr(m, "key_centre")]
    assert stats["kv_key_centres"]["layers"] == len(attention) > 0
    assert all(m.key_centre is not None and m.key_centre.values.abs().sum() > 0 for m in attention)
    # the calibration ran on a manager of its own: no token, step, query or event of it is left
    assert (stats["prompt_tokens"], stats["steps"], stats["prefix_queried_tokens"]) == (0, 0, 0)
    assert engine.take_kv_events() == [] and engine.kv.usage == 0.0
    prompt = [(5 * j) % 200 + 3 for j in range(70)]
    first = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert "cpu:decoder-layers" in engine.stats["backend"]["routes"]  # the C layer subtracts the centre too
    reference = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", kv_cache_dtype="int8", progress=False,
                       backend="torch", dtype="float32")
    assert reference.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_layers_whose_scores_meet_sinks_keep_their_keys_and_float8_or_float_pages_take_no_centre():
    sinks = Engine(tiny_model_dir("tiny-gpt-oss"), kv_cache_memory="8MiB", kv_cache_dtype="int8", progress=False,
                   dtype="float32")
    assert "kv_key_centres" not in sinks.stats and sinks.key_centre_ids == []
    assert all(getattr(m, "key_centre", None) is None for m in sinks.model.cache_layers().values())
    for pages in ("auto", "fp8_e4m3"):
        engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", kv_cache_dtype=pages, progress=False,
                        dtype="float32")
        assert "kv_key_centres" not in engine.stats and not engine.worker.key_centres
    # one kind int8, the other float8: only the int8 layers are centred
    mixed = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="4MiB", progress=False, dtype="float32",
                   kv_cache_dtype={"full_attention": "int8", "sliding_window": "fp8_e4m3"})
    centred = {m.layer_name for m in mixed.model.cache_layers().values() if getattr(m, "key_centre", None) is not None}
    int8 = {n for g in mixed.layout.groups if g.spec.dtype == "int8" for n in g.layer_names}
    assert centred == int8 and 0 < len(centred) < len(mixed.model.cache_layers())
