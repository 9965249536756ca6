"""The hybridkv command."""

import glob
import os

import pytest

from hybridkv.cli import main

MODELS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "models", "*.json")))


@pytest.mark.parametrize("path", MODELS, ids=[os.path.basename(p) for p in MODELS])
def test_plan_works_on_every_model_config(path, capsys):
    assert main(["plan", path, "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "page size" in out and "requests that fit" in out
    for context in ("1024", "8192", "32768", "131072"):
        assert context in out


def test_plan_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing.json")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["plan", MODELS[0], "--memory", "12 potatoes"]) == 2
    assert "cannot read memory size" in capsys.readouterr().err
    assert main(["plan", MODELS[0], "--memory", "1KiB"]) == 2
    assert "null page needs" in capsys.readouterr().err


def test_plan_plot_draws_the_layout(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "layout.png"
    jamba = next(p for p in MODELS if p.endswith("jamba-1.5-mini.json"))
    assert main(["plan", jamba, "--memory", "80GiB", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
