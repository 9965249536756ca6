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
    # `hybridkv demo --tiny --model NAME`: the Mamba-2 hybrids, LFM2, Qwen3-Next
    # and Qwen3.5, each hitting the shared system prompt through its recurrent checkpoints.
    names = ["tiny-nemotron-h", "tiny-granite-4h", "tiny-bamba", "tiny-falcon-h1", "tiny-lfm2", "tiny-qwen3-next",
             "tiny-qwen3.5"]
    args = ["demo", "--tiny", "--requests", "2", "--max-tokens", "2", "--no-progress"]
    assert main(args + [a for name in names for a in ("--model", name)]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert name in out
    assert out.count("mamba2 + full groups") == 3 and "full + mamba2 groups" in out  # Falcon-H1: attention first
    assert "short_conv + full groups" in out and "prefix-cache hit rate" in out
    assert out.count("gated_delta + full groups") == 2


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


def _refuse_bigger_than_memory():
    # A regression must not plan and allocate a budget the size of the
    # machine's memory (shared with other work): address space capped.
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


# What an operator gets wrong, each told in one line before the model loads
# (the context when the model's config is read): the probe got
# 23-76-line tracebacks, the first after 35 s.
MISTAKES = {
    "kv-cache-memory": (["--kv-cache-memory", "1024TiB"], "kv_cache_memory 1024TiB is more than this machine's "
                        "memory ("),
    "kv-host-cache-memory": (["--kv-host-cache-memory", "1024TiB"], "kv_host_cache_memory 1024TiB is more than "
                             "this machine's memory ("),
    "device": (["--device", "cuda:%d"], "this torch"),  # one past the CUDA devices torch sees
    "backend": (["--backend", "triton", "--device", "cpu"], "backend 'triton' runs on CUDA devices, not on cpu"),
    "port": (["--port", "99999"], "--port must be a port number, 0 to 65535, got 99999"),
    "max-model-len": (["--max-model-len", "1000000000"], "max_model_len 1000000000 is more than the model's "
                      "context of 8192 tokens"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_an_operator_mistake_is_one_line_on_stderr_and_exit_code_2(mistake):
    import subprocess
    import sys
    import time

    import torch

    args, says = MISTAKES[mistake]
    args = [a % torch.cuda.device_count() if "%d" in a else a for a in args]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the tests'; no operator's)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=None if mistake == "device" else _refuse_bigger_than_memory)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith("hybridkv serve: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr
    print(f"\n{mistake}: {took:.1f} s: {done.stderr.strip()}")
    assert took < 30
