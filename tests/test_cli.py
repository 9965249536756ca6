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


def test_demo_the_readme_main_job_serves_both_families(capsys):
    # `hybridkv demo`, smaller: every request finishes, the shared system
    # prompt is hit, and the pool holds less than a contiguous cache would.
    assert main(["demo", "--requests", "6", "--max-tokens", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny-gemma3", "tiny-jamba"):
        assert name in out
    assert "sliding_window" in out and "mamba" in out
    from hybridkv.demo import run_model

    row = run_model("tiny-jamba", num_requests=6, max_tokens=4, progress=False)
    assert row["requests"] == 6 and row["tokens_per_s"] > 0
    assert row["hit_rate"] > 0.5  # all six share a ~120-word system prompt
    assert 0 < row["peak_bytes"] < row["contiguous_bytes"]
