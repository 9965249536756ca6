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
    pytest.importorskip("matplotlib", reason="needs the plot extra: pip install -e '.[plot]'")
    out = tmp_path / "layout.png"
    jamba = next(p for p in MODELS if p.endswith("jamba-1.5-mini.json"))
    assert main(["plan", jamba, "--memory", "80GiB", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


def test_demo_tiny_serves_every_family(capsys):
    # `hybridkv demo --tiny`, smaller: every request finishes, the shared
    # system prompt is hit, and the pool holds less than a contiguous cache.
    assert main(["demo", "--tiny", "--requests", "6", "--max-tokens", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name in ("tiny-gemma3", "tiny-jamba", "tiny-gpt-oss"):
        assert name in out
    assert "sliding_window" in out and "mamba" in out
    from hybridkv.demo import run_tiny

    row = run_tiny("tiny-jamba", num_requests=6, max_tokens=4, progress=False)
    assert row["requests"] == 6 and row["tokens_per_s"] > 0
    assert row["hit_rate"] > 0.5  # all six share a ~120-word system prompt
    assert 0 < row["peak_bytes"] < row["contiguous_bytes"]


def test_demo_tiny_runs_one_model_of_every_recurrent_family(capsys):
    # `hybridkv demo --tiny --model NAME`: the Mamba-2 hybrids and LFM2,
    # each hitting the shared system prompt through its recurrent checkpoints.
    names = ["tiny-nemotron-h", "tiny-granite-4h", "tiny-bamba", "tiny-falcon-h1", "tiny-lfm2"]
    args = ["demo", "--tiny", "--requests", "2", "--max-tokens", "2", "--no-progress"]
    assert main(args + [a for name in names for a in ("--model", name)]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert name in out
    assert out.count("mamba2 + full groups") == 3 and "full + mamba2 groups" in out  # Falcon-H1: attention first
    assert "short_conv + full groups" in out and "prefix-cache hit rate" in out


def test_demo_the_readme_main_job_speaks_on_the_real_model(capsys):
    # `hybridkv demo` as the README runs it, shorter: real completions of
    # the library questions, the long prompt past the 512-token window
    # releasing sliding-window pages, hits on the shared preamble.
    from hybridkv.demo import real_model_path

    if real_model_path() is None:
        if os.environ.get("HYBRIDKV_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("HYBRIDKV_REQUIRE_REAL_MODEL=1 but the model package is missing")
        assert main(["demo", "--requests", "2", "--max-tokens", "2", "--no-progress"]) == 0
        assert "tiny-gemma3" in capsys.readouterr().out  # the fallback
        return
    assert main(["demo", "--max-tokens", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "gemma-3-270m" in out and "Q: Where can I find books about the history of Rome?" in out
    answers = [line for line in out.splitlines() if line.strip().startswith("A:")]
    assert len(answers) == 4 and all(len(a.strip()) > 4 for a in answers)
    assert "781-token prompt" in out or "-token prompt]" in out
    released = next(line for line in out.splitlines() if "left the window" in line)
    assert int(released.rsplit(" ", 1)[1]) > 0
    hit = next(line for line in out.splitlines() if "hit rate" in line)
    assert float(hit.split()[3]) > 50
