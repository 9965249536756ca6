"""Engine API: bad input is a ValueError at the boundary and the engine keeps
serving; streaming add_request/step/abort; stop conditions; text prompts."""

from __future__ import annotations

import pytest

from hybridkv import Engine, SamplingParams
from hybridkv.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="32MiB", max_model_len=256, progress=False)




@pytest.mark.parametrize("make", [
    lambda e: e.add_request(""),
    lambda e: e.add_request([]),
    lambda e: e.add_request([1] * 400),  # longer than max_model_len
    lambda e: e.add_request([1, e.vocab_size]),  # outside the vocabulary
    lambda e: e.add_request([1, -3]),
    lambda e: e.add_request([1, 2.5]),
    lambda e: e.add_request(b"bytes"),
    lambda e: e.add_request([1, 2], request_id="dup") and e.add_request([1, 2], request_id="dup"),
    lambda e: e.abort("no-such-request"),
    lambda e: SamplingParams(max_tokens=0),
    lambda e: SamplingParams(temperature=-1),
    lambda e: SamplingParams(top_p=0),
    lambda e: SamplingParams(top_p=1.5),
    lambda e: SamplingParams(n=0),
    lambda e: SamplingParams(top_k=-2),
    lambda e: SamplingParams(stop=[""]),
])
def test_bad_input_is_a_value_error_and_the_engine_keeps_serving(engine, make):
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4), request_id="bystander")
    with pytest.raises(ValueError):
        make(engine)
    outs = engine.drain()
    assert len(outs["bystander"].outputs[0].token_ids) == 4
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
    assert not engine.has_unfinished_requests()


def test_text_prompt_and_token_ids_agree(engine):
    text = "the state of the world"
    ids = engine.tokenizer.encode(text)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = engine.generate([text, ids], params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == text and a.prompt_token_ids == ids
    assert a.outputs[0].text == engine.tokenizer.decode(a.outputs[0].token_ids, skip_special_tokens=True)


def test_streaming_step_and_abort_free_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request([3, 4, 5, 6], params, request_id="keep")
    engine.add_request([3, 4, 5, 9], params, request_id="drop")
    seen = engine.step()
    assert {o.request_id for o in seen} == {"keep", "drop"}
    assert all(len(o.outputs[0].token_ids) == 1 and not o.finished for o in seen)
    engine.step()
    engine.abort("drop")
    assert "drop" not in engine.kv
    outs = engine.drain()
    assert len(outs["keep"].outputs[0].token_ids) == 50
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_stop_token_ids_and_max_tokens(engine):
    free = engine.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[2]
    stopped = engine.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_at]),
                              use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(stop_at) + 1]


def test_stop_string_truncates_the_text(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = engine.generate(["tell me about the library"], params, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = engine.generate(["tell me about the library"],
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop),
                          use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)


def test_generation_stops_at_the_model_context(tmp_path):
    engine = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="32MiB", max_model_len=20, progress=False)
    out = engine.generate([[1] * 15], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_request_that_can_never_fit_the_cache_is_refused_at_admission():
    path = tiny_model_dir("tiny-gemma3")
    probe = Engine(path, kv_cache_memory="32MiB", progress=False)
    pages = probe.layout.pages_per_request(64, chunk=1024) + 2
    small = Engine(path, kv_cache_memory=pages * probe.layout.page_size_bytes, progress=False)
    small.add_request([1] * 20, SamplingParams(max_tokens=40))  # fits
    with pytest.raises(ValueError, match="needs .* KV cache pages"):
        small.add_request([1] * 20, SamplingParams(max_tokens=4000))
    assert len(small.drain()) == 1


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["RwkvForCausalLM"], "model_type": "rwkv"}))
    with pytest.raises(ValueError, match="unsupported architecture.*supported: .*Gemma3ForCausalLM"):
        Engine(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        Engine(str(tmp_path / "missing"))


def test_every_architecture_on_the_supported_list_has_a_model_class():
    from hybridkv.core.hf_config import ENGINE_ARCHITECTURES
    from hybridkv.modeling.loader import _model_classes

    assert set(_model_classes()) == set(ENGINE_ARCHITECTURES.values())


def test_a_stop_string_at_the_very_start_leaves_empty_text(engine):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = engine.generate(["tell me"], params, use_tqdm=False)[0].outputs[0]
    cut = engine.generate(["tell me"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      stop=full.text[:3]), use_tqdm=False)[0].outputs[0]
    assert cut.text == "" and cut.finish_reason == "stop"


def sampled(engine, seed=None, n=1, prompt=(5, 6, 7)):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed, n=n)
    return [c.token_ids for c in engine.generate([list(prompt)], params, use_tqdm=False)[0].outputs]


def test_every_bit_of_a_seed_counts_and_children_have_their_own_streams(engine):
    mine = sampled(engine, seed=7)
    assert sampled(engine, seed=7) == mine
    assert sampled(engine, seed=7 + 2**32) != mine and sampled(engine, seed=7 - 2**32) != mine
    two = sampled(engine, seed=7, n=2)
    assert two[0] == mine[0]  # continuation 0 is the seed's stream whatever n is
    assert two[1] != sampled(engine, seed=8)[0]  # child 1 is not seed + 1


def test_unseeded_requests_draw_fresh_entropy_per_engine_unless_it_has_a_seed():
    path = tiny_model_dir("tiny-gemma3")
    runs = {}
    for name, seed in (("a", None), ("b", None), ("c", 3), ("d", 3)):
        engine = Engine(path, kv_cache_memory="32MiB", max_model_len=256, progress=False, seed=seed)
        runs[name] = [sampled(engine)[0] for _ in range(2)]
        if name == "a":
            seeded_zero = sampled(engine, seed=0)[0]
    assert runs["a"] != runs["b"]  # a restart does not repeat the last run's draws
    assert runs["c"] == runs["d"]  # an engine seed makes runs reproducible
    assert runs["c"][0] != runs["c"][1]
    assert seeded_zero not in runs["a"]
    with pytest.raises(ValueError, match="seed"):
        Engine(path, kv_cache_memory="32MiB", progress=False, seed=2**63)


def test_max_tokens_none_generates_what_fits_the_pool_and_the_context():
    # A pool of 63 pages holds one request of 160 tokens, far from the
    # context of 8192: max_tokens=None asks for what fits, not the context.
    small = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="256KiB", progress=False)
    assert small.max_model_len == 8192 and small.max_tokens_that_fit(30) == 130
    out = small.generate([[5, 6, 7] * 10], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 130 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="at most 130 for this prompt"):
        small.add_request([5, 6, 7] * 10, SamplingParams(max_tokens=131))
    assert small.max_tokens_that_fit(500) == 0
    with pytest.raises(ValueError, match="needs .* KV cache pages"):
        small.add_request([5] * 500, SamplingParams(max_tokens=None))
    assert small.kv.num_free_pages == small.kv.num_total_pages
    roomy = Engine(tiny_model_dir("tiny-gemma3"), kv_cache_memory="32MiB", max_model_len=64, progress=False)
    assert roomy.max_tokens_that_fit(30) == 34  # the context caps it
    out = roomy.generate([[5, 6, 7] * 10], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 34


def test_extreme_temperatures_and_seeds_do_not_break_the_loop(engine):
    tiny = engine.generate([[5, 6]], SamplingParams(temperature=1e-300, max_tokens=4, n=2, seed=2**63 - 1),
                           use_tqdm=False)[0]
    greedy = engine.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert [c.token_ids for c in tiny.outputs] == [greedy.outputs[0].token_ids] * 2
    hot = engine.generate([[5, 6]], SamplingParams(temperature=1e300, max_tokens=4, seed=-(2**63)), use_tqdm=False)
    assert len(hot[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)
