"""The cache identity (core/identity.py): blocks made by other weights are
never served. A fine-tune that changes only one late layer (the bytes past
its file's header and embedding) gets another identity, and over the base
model's disk tier it gives the tokens of a cold run; the weights' digests
are remembered by file, and a file rewritten in place is hashed again."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.core.identity import file_digest, model_files, weights_fingerprint
from hybridkv.core.layout import plan_layout
from hybridkv.core.specs import FullAttentionSpec
from hybridkv.tiers import kv_identity

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDKV_CACHE", str(tmp_path / "cache"))


def base_model(path) -> str:
    """A tiny Gemma-3 whose embedding alone is 1 MiB: safetensors keeps
    tensors sorted by name, so every layer's bytes lie past the first MiB
    of the file (where an identity of file heads stopped looking)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512)
    Gemma3ForCausalLM(config).save_pretrained(path)
    return str(path)


def fine_tune(base: str, path) -> str:
    """A copy of `base` with its last layer's projections scaled: the same
    names, shapes, sizes and first MiB, other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, path)
    weights = load_file(os.path.join(base, "model.safetensors"))
    for name in weights:
        if name.startswith("model.layers.3.") and name.endswith("proj.weight"):
            weights[name] = weights[name] * 3.0
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def engine(path, **kw) -> Engine:
    return Engine(path, kv_cache_memory="8MiB", block_size=4, progress=False, max_model_len=256, **kw)


def test_a_fine_tune_of_one_late_layer_never_reads_the_base_models_disk_tier(tmp_path):
    base = base_model(tmp_path / "base")
    tuned = fine_tune(base, tmp_path / "tuned")
    with open(os.path.join(base, "model.safetensors"), "rb") as a, \
            open(os.path.join(tuned, "model.safetensors"), "rb") as b:
        assert a.read(1 << 20) == b.read(1 << 20), "the fine-tune should differ only past the first MiB"
    disk = tmp_path / "disk"
    prompts = [[(7 * d + 3 * j) % 4000 + 10 for j in range(60)] for d in range(3)]

    first = engine(base, kv_disk_cache=str(disk))
    base_tokens = [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)]
    first.close()
    cold = engine(tuned)
    cold_tokens = [o.outputs[0].token_ids for o in cold.generate(prompts, GREEDY, use_tqdm=False)]
    assert cold_tokens != base_tokens, "the fine-tune should change what the model says"

    over_base = engine(tuned, kv_disk_cache=str(disk))
    outs = over_base.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cold_tokens
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 0]
    # And the base model itself still hits its own blocks.
    again = engine(base, kv_disk_cache=str(disk))
    outs = again.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base_tokens
    assert all(o.metrics.num_cached_tokens >= 56 for o in outs)


def layout():
    return plan_layout({"layers.0": FullAttentionSpec(num_kv_heads=2, head_size=16, dtype="float32")},
                       memory_bytes=1 << 20, block_size=16)


def test_every_file_that_decides_the_kv_is_in_the_identity_and_nothing_else(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                 "README.md", "notes.txt"):
        (folder / name).write_bytes(name.encode() * 100)
    (folder / "kv-cache").mkdir()  # a disk tier placed inside the folder is not the model
    names = [os.path.basename(p) for p in model_files(str(folder))]
    assert names == ["config.json", "model-00001-of-00002.safetensors", "pytorch_model.bin", "tokenizer.json"]
    before = kv_identity(str(folder), "float32", layout())
    assert kv_identity(str(folder), "float32", layout()) == before
    (folder / "README.md").write_text("other words")
    assert kv_identity(str(folder), "float32", layout()) == before
    for name in ("config.json", "tokenizer.json", "pytorch_model.bin"):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[:-1] + b"!")  # the last byte of the file
        assert kv_identity(str(folder), "float32", layout()) != before, name
        (folder / name).write_bytes(data)
        assert kv_identity(str(folder), "float32", layout()) == before
    assert kv_identity(str(folder), "bfloat16", layout()) != before
    assert kv_identity(str(folder), "float32", layout(), extra="rank 1 of 2") != before


def test_a_digest_is_remembered_by_file_and_a_file_rewritten_in_place_is_hashed_again(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 4096)
    first = file_digest(str(path))
    # Remembered: the second call reads none of the file's bytes.
    reads = []
    real_open = open

    def counting_open(file, mode="r", *args, **kw):
        if os.fspath(file) == str(path):
            reads.append(mode)
        return real_open(file, mode, *args, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    assert file_digest(str(path)) == first and reads == []
    monkeypatch.undo()
    # The same size and modification time, other bytes: its change time moved, so it is hashed again.
    stat = os.stat(path)
    path.write_bytes(b"b" * 4096)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == stat.st_mtime_ns
    assert file_digest(str(path)) != first
    # A cache folder that cannot be written still gives the digest.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("HYBRIDKV_CACHE", str(blocker))
    assert file_digest(str(path)) == weights_fingerprint(str(tmp_path))[0][2]
