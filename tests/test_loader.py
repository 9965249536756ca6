"""The safetensors reader under the model loader: every dtype read back
exactly as the safetensors package wrote it, only the tensors asked for,
and a damaged file is a clear ValueError."""

import os

import pytest
import torch
from safetensors.torch import save_file

from hybridkv.modeling.loader import read_safetensors


@pytest.fixture
def checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.f32": torch.randn(3, 5, generator=gen),
        "b.bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.f16": torch.randn(2, 2, 2, generator=gen).to(torch.float16),
        "d.i64": torch.arange(6).view(2, 3),
        "e.scalar": torch.tensor(1.5),
        "f.empty": torch.zeros(0, 4),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path, tensors


def test_every_tensor_reads_back_exactly(checkpoint):
    path, tensors = checkpoint
    got = dict(read_safetensors(path))
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_only_wanted_tensors_are_read(checkpoint):
    path, _ = checkpoint
    assert [n for n, _ in read_safetensors(path, lambda n: n.startswith("b"))] == ["b.bf16"]


def test_damaged_files_are_clear_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    size = os.path.getsize(path)
    os.truncate(path, size - 10)
    with pytest.raises(ValueError, match="truncated"):
        list(read_safetensors(path))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        list(read_safetensors(str(junk)))


def test_building_a_model_skips_its_random_initialisation_and_restores_torchs():
    # In a process of its own: the model is built on the meta device with
    # torch.nn.init's initialisers skipped (their first op there imports
    # torch._dynamo, ~1 s of every process that loads a model), and they
    # are torch's own again after, also when the build fails.
    import subprocess
    import sys

    script = """
import sys, torch
from torch.nn import init
from hybridkv.modeling.loader import load_model, initialisers_skipped, INITIALISERS
from hybridkv.tiny_models import tiny_model_dir
before = {name: getattr(init, name) for name in INITIALISERS}
model, _ = load_model(tiny_model_dir("tiny-gemma3"), progress=False)
assert "torch._dynamo" not in sys.modules, "building the model imported torch._dynamo"
assert all(getattr(init, name) is f for name, f in before.items())
assert not any(p.is_meta for p in model.parameters())
try:
    with initialisers_skipped():
        raise KeyError("a failed build")
except KeyError:
    pass
assert all(getattr(init, name) is f for name, f in before.items())
t = torch.zeros(3)
init.ones_(t)
assert t.tolist() == [1.0, 1.0, 1.0]
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
