import pytest

from hybridkv.core import ChunkedLocalSpec, FullAttentionSpec, MambaSpec, RecurrentSpec, SlidingWindowSpec
from hybridkv.core.hf_config import load_config, specs_from_config


def test_spec_bytes():
    assert FullAttentionSpec(num_kv_heads=8, head_size=128, dtype="bfloat16").bytes_per_token == 4096
    assert SlidingWindowSpec(num_kv_heads=1, head_size=4, dtype="float32", sliding_window=3).block_bytes(16) == 512
    assert MambaSpec(shapes=((8192, 3), (8192, 16)), dtypes=("bfloat16", "float32")).state_bytes == 49152 + 524288


@pytest.mark.parametrize("make", [
    lambda: FullAttentionSpec(num_kv_heads=0, head_size=8),
    lambda: FullAttentionSpec(num_kv_heads=2, head_size=-8),
    lambda: FullAttentionSpec(num_kv_heads=2, head_size=8, dtype="float13"),
    lambda: SlidingWindowSpec(num_kv_heads=2, head_size=8, sliding_window=0),
    lambda: ChunkedLocalSpec(num_kv_heads=2, head_size=8, chunk_size=-1),
    lambda: MambaSpec(shapes=((8, 0),), dtypes=("float32",)),
    lambda: MambaSpec(shapes=((8, 3), (8, 4)), dtypes=("float32",)),
    lambda: RecurrentSpec(shapes=((8, 3),), dtypes=("float32",), kind="rwkv"),
])
def test_non_positive_or_unknown_spec_values_are_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_the_core_dtype_table_agrees_with_torch_and_aliases_name_the_same_dtype():
    import torch

    from hybridkv.core.dtypes import DTYPE_SIZES, dtype_name
    from hybridkv.layers.dtypes import TORCH_DTYPES

    for name, torch_dtype in TORCH_DTYPES.items():
        assert torch.empty(0, dtype=torch_dtype).element_size() == DTYPE_SIZES[name]
        assert dtype_name(torch_dtype) == name
    assert dtype_name("bf16") == dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name("half") == "float16" and dtype_name("fp32") == "float32"
    assert dtype_name("float13") is None


def _mix(name):
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "models", name)
    specs = specs_from_config(load_config(path))
    counts = {}
    for spec in specs.values():
        key = spec.kind + (f"{spec.sliding_window}" if spec.kind == "sliding_window" else "")
        counts[key] = counts.get(key, 0) + 1
    return counts, specs


@pytest.mark.parametrize("name,expected", [
    ("gemma-3-1b.json", {"sliding_window512": 22, "full": 4}),
    ("gemma-3-27b.json", {"sliding_window1024": 52, "full": 10}),
    ("gemma-2-27b.json", {"sliding_window4096": 23, "full": 23}),
    ("gpt-oss-20b.json", {"sliding_window128": 12, "full": 12}),
    ("mistral-7b-v0.1.json", {"sliding_window4096": 32}),
    ("llama-4-scout.json", {"chunked_local": 36, "full": 12}),
    ("jamba-1.5-mini.json", {"mamba": 28, "full": 4}),
    ("nemotron-h-8b.json", {"mamba2": 24, "full": 4}),
    ("qwen3-next-80b-a3b.json", {"gated_delta": 36, "full": 12}),
    ("granite-4.0-h-tiny.json", {"mamba2": 36, "full": 4}),
    ("lfm2-1.2b.json", {"short_conv": 10, "full": 6}),
    ("falcon-h1-0.5b.json", {"mamba2": 36, "full": 36}),
    ("llama-3.1-8b.json", {"full": 32}),
])
def test_hybrid_layer_mix_read_from_real_configs(name, expected):
    counts, specs = _mix(name)
    assert counts == expected


def test_gemma3_sliding_layers_follow_the_pattern():
    _, specs = _mix("gemma-3-1b.json")
    full = [int(name.rsplit(".", 1)[1]) for name, s in specs.items() if s.kind == "full"]
    assert full == [5, 11, 17, 23]


def test_jamba_state_shapes():
    _, specs = _mix("jamba-1.5-mini.json")
    mamba = next(s for s in specs.values() if s.kind == "mamba")
    assert mamba.shapes == ((8192, 3), (8192, 16))


def test_unknown_architecture_names_what_is_supported():
    with pytest.raises(ValueError, match="unsupported architecture.*supported model types: .*gemma3"):
        specs_from_config({"model_type": "rwkv7", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="missing 'sliding_window'"):
        specs_from_config({"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 2,
                           "head_dim": 8, "layer_types": ["sliding_attention"] * 6})


def test_every_recurrent_kind_is_one_spec_and_mixers_never_share_a_group():
    # MambaSpec (the public name) is the recurrent spec of kind "mamba"; a
    # state of the same shapes but another mixer is another group, and the
    # layout says which mixer each group steps (and reads it back).
    from hybridkv.core import plan_layout
    from hybridkv.core.layout import KVCacheLayout

    shapes, dtypes = ((16, 3), (16, 8)), ("float32", "float32")
    assert MambaSpec(shapes=shapes, dtypes=dtypes) == RecurrentSpec(shapes=shapes, dtypes=dtypes, kind="mamba")
    specs = {"l0": MambaSpec(shapes=shapes, dtypes=dtypes), "l1": RecurrentSpec(shapes, dtypes, kind="mamba2"),
             "l2": RecurrentSpec(((16, 3),), ("float32",), kind="short_conv"), "l3": FullAttentionSpec(2, 8)}
    layout = plan_layout(specs, 1 << 20, block_size=4)
    assert [(g.kind, g.recurrent) for g in layout.groups] == [
        ("mamba", True), ("mamba2", True), ("short_conv", True), ("full", False)]
    assert KVCacheLayout.from_dict(layout.to_dict()) == layout
