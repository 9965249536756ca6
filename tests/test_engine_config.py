"""EngineConfig: every engine option checked in one place, before anything
loads; Engine(model, **options), the CLI and EngineConfig agree."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from hybridkv import Engine, EngineConfig, SamplingParams
from hybridkv.cli import main
from hybridkv.tiny_models import tiny_model_dir


@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive integer"),
    (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"),
    (dict(tensor_parallel_timeout=0), "tensor_parallel_timeout must be a positive number of seconds"),
    (dict(tensor_parallel_heartbeat_timeout=float("nan")), "tensor_parallel_heartbeat_timeout must be a positive"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(seed=2**63), "seed must be an integer"),
    (dict(kv_cache_memory="12 potatoes"), "kv_cache_memory: cannot read memory size"),
    (dict(kv_host_cache_memory=0), "kv_host_cache_memory: memory size must be positive"),
    (dict(kv_disk_cache_memory="lots"), "kv_disk_cache_memory"),
    (dict(kv_disk_cache=""), "kv_disk_cache must be a directory"),
    (dict(kv_disk_cache="/tmp/x", enable_prefix_caching=False), "need prefix caching"),
    (dict(kv_role="prefill"), "kv_role 'prefill' needs kv_disk_cache"),
    (dict(kv_role="both", kv_disk_cache="/tmp/x"), "kv_role must be None, 'prefill' or 'decode'"),
    (dict(speculative_method="eagle"), "speculative_method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", prompt_lookup_min=5), "prompt_lookup_min .5. is above"),
    (dict(checkpoint_policy="sometimes"), "unknown checkpoint policy"),
    (dict(dtype="int3"), "dtype must be 'auto'"),
    (dict(device="abacus"), "device must name a torch device"),
    (dict(backend="fortran"), "unknown backend 'fortran'"),
    (dict(enforce_eager="yes"), "enforce_eager must be True or False"),
    (dict(fixed_shape_decode=1), "fixed_shape_decode must be True or False"),
    (dict(kv_cache_dtype="int4"), "'int4' is not a KV cache dtype"),
    (dict(kv_cache_dtype={"recurrent": "int8"}), "unknown layer kind"),
    (dict(recurrent_state_dtype="int8"), "never quantized"),
])
def test_each_bad_option_is_a_clear_error_before_loading(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig("no/such/model", **options)
    with pytest.raises(ValueError, match=message):  # checked before the model folder is looked at
        Engine("no/such/model", **options)


def test_an_unknown_option_names_the_nearest_known_one():
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq' .did you mean 'max_num_seqs'"):
        Engine("no/such/model", max_num_seq=4)
    with pytest.raises(ValueError, match="model must be"):
        EngineConfig("")


def test_the_config_is_every_documented_keyword_with_its_default():
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert fields.pop("model") is dataclasses.MISSING
    assert fields == dict(
        kv_cache_memory="2GiB", kv_cache_dtype="auto", recurrent_state_dtype="float32", block_size=None,
        enable_prefix_caching=True, checkpoint_policy="hybridkv",
        enable_kv_events=False, kv_host_cache_memory=None, kv_disk_cache=None, kv_disk_cache_memory="16GiB",
        kv_role=None, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=None, seed=None, speculative_method=None,
        num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, dtype=None, device="cpu",
        backend=None, enforce_eager=False, fixed_shape_decode=None, tensor_parallel_size=1,
        tensor_parallel_timeout=600.0, tensor_parallel_heartbeat_timeout=5.0, progress=True)
    config = EngineConfig("m", speculative_method="ngram", kv_disk_cache="/tmp/d")
    assert config.speculative == (4, 2, 4) and config.tiers
    assert EngineConfig.build(config) is config
    assert EngineConfig.build(config, block_size=32) == config.replace(block_size=32)
    assert EngineConfig("m", **config.options()) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8
    with pytest.raises(ValueError, match="block_size"):
        config.replace(block_size=0)
    assert list(inspect.signature(Engine).parameters) == ["model_dir", "options"]


def test_an_engine_from_a_config_equals_one_from_keywords():
    path = tiny_model_dir("tiny-gemma3")
    config = EngineConfig(path, kv_cache_memory="16MiB", max_num_seqs=4, progress=False, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = Engine(config)
    b = Engine(path, **config.options())
    assert a.engine_config == b.engine_config == config
    assert ([o.outputs[0].token_ids for o in a.generate([[5, 6, 7]], params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in b.generate([[5, 6, 7]], params, use_tqdm=False)])
    assert a.scheduler.max_num_seqs == 4


def test_the_cli_checks_engine_options_before_starting_a_server(capsys):
    assert main(["serve", "--block-size", "0"]) == 2
    assert "block_size must be a positive integer" in capsys.readouterr().err
    assert main(["serve", "--kv-cache-memory", "12 potatoes", "--replicas", "2"]) == 2
    assert "kv_cache_memory" in capsys.readouterr().err
    assert main(["serve", "--tensor-parallel-heartbeat-timeout", "0"]) == 2
    assert "tensor_parallel_heartbeat_timeout must be a positive number of seconds" in capsys.readouterr().err
