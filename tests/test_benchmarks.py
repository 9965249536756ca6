"""Every benchmark runs in --quick mode and prints a well-formed table and
result (no timing is asserted: these machines are noisy)."""

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import harness, manager_overhead, render
from benchmarks.replay_trace import CONFIGS, MODELS_DIR, TRACES, Waiting, generated, make_chats, trace_named
from hybridkv.core import KVCacheManager, plan_layout
from hybridkv.core.hf_config import load_config, specs_from_config
from real_model import real_gguf_path

ROOT = os.path.join(os.path.dirname(__file__), "..")


def run(script, tmp_path, *extra):
    """`python -m benchmarks.SCRIPT --quick`: its stdout and its result's tables."""
    out = tmp_path / f"{script}.json"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--quick", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == script and result["command"].startswith(f"python -m benchmarks.{script} --quick")
    assert result["environment"]["cores"] > 0 and result["environment"]["packages"]
    return proc.stdout, result["tables"]


def test_manager_overhead_quick(tmp_path):
    text, data = run("manager_overhead", tmp_path)
    assert "us/decode step" in text and "pool pages" in text
    for row in data["models"]:
        assert row["admissions"] > 0 and row["us_per_decode_step"] > 0 and 0 <= row["hit_rate"] <= 1
    assert {(row["model"], row["trace"]) for row in data["models"]} == {(m, t) for m in CONFIGS for t in TRACES}
    # every model, recurrent ones included, reuses the previous turn of a chat
    assert all(row["hit_tokens"] > 0 for row in data["models"] if row["trace"] == "multi-turn")
    assert data["scaling"]  # small pools hold no Gemma-3-27B rows in --quick


def test_unique_prompt_traces_share_no_block_and_bad_names_are_refused(tmp_path):
    trace = trace_named("unique-64", 30)
    assert len(trace) == 30 and all(len(r.tokens) == 64 and r.outputs == 20 for r in trace)
    assert len({tuple(r.tokens[:16]) for r in trace}) == 30  # not even a first block in common
    assert trace_named("mixed", 5) == TRACES["mixed"](5)
    for bad in ("unique-", "unique-0", "unique-x", "nope"):
        with pytest.raises(ValueError, match="unknown trace"):
            trace_named(bad, 5)
    text, data = run("manager_overhead", tmp_path, "--traces", "unique-32,unique-128", "--wide-block", "0")
    rows = {(row["model"], row["trace"]): row for row in data["models"]}
    assert set(rows) == {(m, t) for m in CONFIGS for t in ("unique-32", "unique-128")}
    assert all(row["hit_tokens"] == 0 and row["admissions"] == 60 for row in rows.values())


def test_a_chat_turn_extends_the_previous_one_and_arrives_when_it_finished():
    trace = make_chats(40)
    assert any(r.after is not None for r in trace)
    for i, r in enumerate(trace):
        if r.after is not None:
            prev = trace[r.after]
            assert r.after < i and r.tokens[:len(prev.tokens)] == prev.tokens
            assert r.tokens[len(prev.tokens):len(prev.tokens) + prev.outputs] == generated(prev.outputs, prev.samples)
            assert len(r.tokens) > len(prev.tokens) + prev.outputs  # and a new message
    waiting = Waiting(trace)
    first = {f"r{i}" for i, r in enumerate(trace) if r.after is None}
    seen = []
    while waiting:
        seen.append(waiting.head()[0])
        waiting.admitted()
    assert set(seen) == first  # later turns wait for theirs
    waiting.finished(seen[0])
    follower = next(i for i, r in enumerate(trace) if r.after == int(seen[0][1:]))
    assert waiting.head()[0] == f"r{follower}"


def test_the_second_turn_of_a_chat_hits_everything_the_replay_decoded_in_the_first():
    """The replay loop decodes `generated(...)`: the next turn's prompt then
    extends the cached sequence, and on full attention hits all of it but
    the last partial block."""
    trace = make_chats(2, turns=(2, 2))
    path = os.path.join(MODELS_DIR, CONFIGS["full-only (Llama-3.1-8B)"])
    row = manager_overhead.replay(KVCacheManager(plan_layout(specs_from_config(load_config(path)), "4GiB")), trace)
    first = trace[0]
    assert row["hit_tokens"] == (len(first.tokens) + first.outputs - 1) // 16 * 16


def test_manager_overhead_with_events_quick(tmp_path):
    text, data = run("manager_overhead", tmp_path, "--events")
    assert "KV events on" in text
    assert [row["model"] for row in data["events"]] == [row["model"] for row in data["models"]]
    assert all(row["on"]["us_per_admission"] > 0 for row in data["events"])


def test_kv_event_wire_quick(tmp_path):
    text, data = run("kv_event_wire", tmp_path)
    assert "batches/s over ZMQ" in text
    assert all(row["blocks_stored"] > 0 and row["zmq_batches_per_s"] for row in data["models"])


def test_memory_quick(tmp_path):
    text, data = run("memory", tmp_path)
    assert "Requests that fit" in text
    for row in data["models"]:
        assert row["waste_fraction"] <= 0.01
        for cell in row["mix"].values():
            assert cell["hybridkv"] > 0 and cell["contiguous"] > 0


def test_handoff_bytes_quick(tmp_path):
    text, data = run("handoff_bytes", tmp_path)
    assert "gemma-3-1b" in text
    rows = {row["model"]: row for row in data["models"]}
    for row in rows.values():
        for cell in row["prompts"].values():
            assert 0 < cell["bytes"] <= cell["all_layers_bytes"]
    assert rows["gemma-3-1b"]["prompts"]["4096"]["fraction"] < 0.3  # 4 full layers of 26, the rest in a 512 window
    assert rows["llama-3.1-8b"]["prompts"]["4096"]["fraction"] == 1.0  # full attention: every block


def test_kv_dtypes_quick(tmp_path):
    text, data = run("kv_dtypes", tmp_path)
    assert "ratio to bfloat16 pages" in text
    for row in data["capacity"]["rows"]:
        for cell in row["int8"].values():
            assert 1.0 < cell["ratio"] and cell["ratio"] == pytest.approx(cell["exact"], rel=0.05)
    rows = {r["config"]: r for r in data["accuracy"]["rows"]}  # the tiny random model's, in --quick
    assert rows["float32"]["top1_agreement"] == 1.0 and rows["int8"]["pages"] == ["int8"]
    assert rows["int8"]["positions"] == 2 * 79 and abs(rows["int8"]["perplexity_change"]) < 0.05
    speed = data["speed"]["rows"]
    assert [r["batch"] for r in speed] == [2] and speed[0]["int8"]["step_ms"] > 0 and speed[0]["fp8_e4m3"]["step_ms"] > 0
    assert speed[0]["made"] == ["floor", "auto", "int8", "fp8_e4m3"]  # (--reverse: the floor, then the other way round)
    # The floor: int8 pages at a quarter of the 64-token context, in the same turns; the ceiling its ratio.
    assert speed[0]["floor"]["context"] == 16 and speed[0]["ceiling"] == speed[0]["auto"]["step_ms"] / speed[0]["floor"]["step_ms"]
    assert "floor (int8 pages, 16 tokens)" in text


def test_kv_int8_options_quick(tmp_path):
    text, data = run("kv_int8_options", tmp_path)
    rows = {r["variant"]: r for r in data["rows"]}
    assert "int8, K less a constant per layer (the format)" in rows and len(rows) == 9
    # bfloat16 rounding moves less than int8 codes; every variant scored the same positions
    assert {r["positions"] for r in rows.values()} == {2 * 79}
    assert abs(rows["bfloat16 pages"]["perplexity_change"]) <= abs(rows["int8 K only"]["perplexity_change"]) + 1e-3


def test_prefill_tiles_quick(tmp_path):
    text, data = run("prefill_tiles", tmp_path)
    assert "query tiles" in text
    assert data["models"] and all(row["one_call_s"] > 0 and row["query_tiles_s"] > 0 for row in data["models"])


def test_decode_attention_quick(tmp_path):
    # (the baseline: the committed kernels.c, built beside this tree's; both must give the same outputs)
    text, data = run("decode_attention", tmp_path, "--baseline", "HEAD")
    assert "GB/s" in text
    cases = data["cases"]
    assert {row["dtype"] for row in cases} == {"float32", "bfloat16", "int8"}
    assert all(row["this"]["ms"] > 0 and row["baseline"]["gb_per_s"] > 0 and row["speedup"] > 0 for row in cases)


def test_hybrid_prefix_quick(tmp_path):
    text, data = run("hybrid_prefix", tmp_path)
    [row] = data["budgets"]
    assert {"every_block", "prompt_end", "hybridkv"} <= set(row)
    assert row["hybridkv"]["hit_rate"] > 0 and "hit rate" in text


def test_engine_throughput_quick(tmp_path):
    text, data = run("engine_throughput", tmp_path)
    assert "speedup" in text and "TTFT" in text
    row = data["throughput"][0]
    assert row["hybridkv"]["tokens_per_s"] > 0 and row["transformers"]["tokens_per_s"] > 0
    assert data["shared_prefix"][0]["on"]["hit_rate"] > 0


def test_kernels_quick(tmp_path):
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    text, data = run("kernels", tmp_path)
    assert "GB/s" in text and data


def test_cpu_linear_quick(tmp_path):
    text, data = run("cpu_linear", tmp_path)
    assert "oneDNN packed" in text
    assert all(row["f_linear_s"] > 0 and row["onednn_packed_s"] > 0 for row in data["products"])


def test_recurrent_prefill_quick(tmp_path):
    text, data = run("recurrent_prefill", tmp_path)
    (row,) = data["prefill"]
    assert row["lone_prompt_steps"] == 1 and row["ttft_mean"] > 0 and row["code"] == "this tree"
    assert "lone prompt steps" in text


def test_recurrent_kernels_quick(tmp_path):
    text, data = run("recurrent_kernels", tmp_path)
    assert "speed-up" in text
    assert {(row["kind"], row["work"]) for row in data["tokens"]} == {
        (kind, work) for kind in ("gated_delta", "ssd") for work in ("decode", "prefill")}
    assert all(row["reference_us_per_token"] > 0 and row["c_us_per_token"] > 0 for row in data["tokens"])


def test_real_gemma3_quick(tmp_path):
    real_gguf_path()
    text, data = run("real_gemma3", tmp_path, "--no-llamacpp")
    median = {(c["workload"], c["engine"]): c for c in data["medians"]}
    assert "staggered" in text and {e for _, e in median} == {"hybridkv", "transformers"}
    for engine in ("hybridkv", "transformers"):
        assert median["batch-2", engine]["tokens_per_s"] > 0
    assert median["staggered", "hybridkv"]["hit_rate"] > 0.5
    ratios = {(r["workload"], r["engine"]) for r in data["ratios"]}
    assert ratios == {(w, "transformers") for w in ("batch-2", "staggered")}
    # The same token ids in, the same greedy tokens out.
    ids = {row["engine"]: row["first_ids"] for row in data["engines"]}
    assert ids["hybridkv"] == ids["transformers"], ids


def test_cpu_decode_step_quick(tmp_path):
    real_gguf_path()
    text, data = run("cpu_decode_step", tmp_path)
    assert "the floor of this design" in text
    # The script itself fails when a configuration changes the tokens.
    assert [row["batch"] for row in data["steps"]] == [1, 2]
    assert all(row["engine_s"] > 0 and row["layer_modules_s"] > 0 and row["gathered_decode_s"] > 0
               and row["torch_elementwise_s"] > 0 for row in data["steps"])
    [batch1] = data["batch1"]
    assert batch1["linears_s"] > 0 and batch1["read_s"] > 0 and len(data["first_ids"][0]["ids"]) == 6


@pytest.mark.soak  # ~2 min on 2 cores; run by hand before a GPU run (pytest -m soak -k gpu_suite)
def test_gpu_suite_dry_run_builds_every_case(tmp_path):
    # benchmarks/gpu_suite.sh --dry-run: every part of the GPU run, small and
    # on the CPU (kernels under triton's interpreter), so that the script is
    # known to work before a GPU is lent.
    pytest.importorskip("triton", reason="needs the triton extra: pip install -e '.[triton]'")
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), str(out), "--dry-run"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:]
    for model in ("gemma3", "jamba"):
        rows = json.loads((out / f"engine_{model}.json").read_text())["tables"]["throughput"]
        assert {r["model"] for r in rows} == {f"{model}-1b-shape"} and {r["batch"] for r in rows} == {1, 4}
        for r in rows:  # the default backend's row and a named backend's, against the weights-read bound
            assert r["hybridkv"]["tokens_per_s"] > 0 and r["torch"]["tokens_per_s"] > 0
            assert r["weight_bound_tokens_per_s"] > 0 and "transformers" not in r
    prefill = json.loads((out / "prefill.json").read_text())["tables"]["kernels"]
    assert prefill and {r["kernel"] for r in prefill} == {"paged prefill attention"}
    profiled = json.loads((out / "profile.json").read_text())["tables"]["cases"]
    assert profiled and all(c["step_ms"] > 0 and c["launches"] > 0 and c["top"] for c in profiled)
    for name in ("env", "install", "kernel_tests", "oracle", "profile"):
        assert (out / f"{name}.txt").stat().st_size > 0
    assert "no wheels carried" in (out / "install.txt").read_text()


def test_gpu_suite_default_parts_fit_one_device_call():
    # A lent GPU gives ~15 device minutes and 10 a call: the default parts'
    # limits (the install, prefill, engine and profile parts) must leave a
    # 9-minute call room for the machine's start and env.txt.
    script = open(os.path.join(ROOT, "benchmarks", "gpu_suite.sh")).read()
    default = script.split('DEFAULT_PARTS="', 1)[1].split('"', 1)[0].split()
    gpu_branch = script.split("\nelse\n", 1)[1]
    limits = dict(re.findall(r"^\s*part (\w+) (\d+)", script.split("if [ \"$DRY\"", 1)[0] + gpu_branch, re.M))
    assert set(default) <= set(limits), f"a default part without a GPU limit: {set(default) - set(limits)}"
    assert sum(int(limits[p]) for p in default) <= 510


def test_speculative_quick(tmp_path):
    text, data = run("speculative", tmp_path)
    assert "+ngram" in text and "accepted" in text
    for row in data["cells"]:
        assert row["identical"]["hybridkv"] is not False  # speculation never changes greedy tokens
        assert row["hybridkv+ngram"]["tokens_per_s"] > 0
    assert any(row["hybridkv+ngram"]["drafts"] > 0 for row in data["cells"])


def test_kv_tiers_quick(tmp_path):
    text, data = run("kv_tiers", tmp_path)
    assert "mean TTFT ms" in text and "after a restart" in text
    [workload], [restart] = data["workload"], data["restart"]
    assert workload["working_set_bytes"] > 2 * workload["pool_bytes"]
    tiers = {row["tier"]: row for row in data["tiers"]}
    for name in ("host", "disk", "host+disk"):  # every tier serves hits the pool alone lost
        assert tiers[name]["cached_fraction"] > tiers["none"]["cached_fraction"]
    assert restart["cached_tokens"] > 0


def test_prefix_index_quick(tmp_path):
    text, data = run("prefix_index", tmp_path)
    assert "us/best" in text
    [row] = data["index"]
    assert row["keys_indexed"] > 0 and row["us_per_best"] > 0 and row["bytes_per_block"] > 0


def test_tier_storage_quick(tmp_path):
    text, data = run("tier_storage", tmp_path)
    assert "write us/block" in text
    files = next(row for row in data["stores"] if row["store"] == "files")
    assert files["write_us"] > 0 and files["read_us"] > 0


def test_cache_identity_quick(tmp_path):
    text, data = run("cache_identity", tmp_path)
    assert "remembered" in text
    rows = {row["digest"]: row for row in data["identity"]}
    assert rows["first start"]["bytes"] > 0 and rows["remembered"]["ms"]["median"] >= 0


def test_kv_tiers_counts_what_each_group_stored(tmp_path):
    text, data = run("kv_tiers", tmp_path, "--model", "tiny-jamba")
    assert "store-everything tier" in text
    host = next(row for row in data["tiers"] if row["tier"] == "host")
    # Mamba keeps checkpoint states, not a state per block.
    assert host["stored_bytes_per_cached_token"] < host["store_everything_bytes_per_cached_token"]


def test_replica_routing_quick(tmp_path):
    text, data = run("replica_routing", tmp_path)
    assert "misroutes" in text and "queued_request_tokens swept" in text
    for layout in data["layouts"]:
        rows = {row["router"]: row for row in data["routers"] if row["layout"] == layout["layout"]}
        assert set(rows) == {"single cache", "round robin", "token prefix", "hybrid (hit only)", "hybrid"}
        assert rows["hybrid"]["predictions_checked"] == rows["hybrid"]["requests"] > 0
        assert rows["round robin"]["hit_rate"] < rows["hybrid"]["hit_rate"]
        swept = {row["queued_request_tokens"] for row in data["sweep"] if row["layout"] == layout["layout"]}
        assert swept == {0, 64, 256, 1024}


def test_tensor_parallel_quick(tmp_path):
    text, data = run("tensor_parallel", tmp_path)
    assert "all-reduces" in text and "host ms" in text
    assert {row["tp"] for row in data["steps"]} == {1, 2} and all(row["same_tokens"] for row in data["steps"])
    assert all(row["host_ms_per_step"] > 0 for row in data["steps"])
    assert all(row["all_reduces_per_step"] > 0 and row["plan_us_per_step"] > 0
               for row in data["steps"] if row["tp"] == 2)


def test_step_times_quick(tmp_path):
    # --quick is its --dry-run: a tiny model on the CPU, decode at fixed shapes.
    text, data = run("step_times", tmp_path)
    # Both engines, decode steps apart from the steps with a prefill chunk.
    assert {(r["engine"], r["kind"]) for r in data["steps"]} == {(m, k) for m in ("graphs", "eager")
                                                                 for k in ("decode", "mixed")}
    assert all(r["steps"] > 0 and r["median_ms"] > 0 for r in data["steps"])


@pytest.mark.soak  # ~50 s (a Ray cluster of its own); test_ray_replicas.py covers the replicas
def test_ray_replicas_quick(tmp_path):
    pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")
    text, data = run("ray_replicas", tmp_path, "--models", "tiny-gemma3")
    assert {row["router"] for row in data["routers"]} == {"hybrid", "default"}
    assert all(row["hit_rate"] > 0 and row["ttft_mean_ms"] > 0 for row in data["routers"])


def test_disaggregated_quick(tmp_path):
    pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")
    pytest.importorskip("fastapi", reason="needs the server extra: pip install -e '.[server]'")
    text, data = run("disaggregated", tmp_path)
    configs = {row["config"]: row for row in data["configs"]}
    assert set(configs) == {"2 replicas", "1 prefill + 1 decode"}
    assert configs["1 prefill + 1 decode"]["cached_fraction"] > 0.5  # the decode replica's hits come from the transfer
    assert all(row["ttft_mean_ms"] > 0 and row["itl_mean_ms"] > 0 for row in configs.values())
    assert all(0 < t["bytes"] <= t["all_layers_bytes"] for t in data["transfer"])


def test_vllm_replay_quick(tmp_path):
    pytest.importorskip("vllm", reason="needs vLLM (the vllm extra, in an environment of its own: docs/integrations.md)")
    text, data = run("vllm_replay", tmp_path)
    assert all(row["admissions"] > 0 for row in data["models"])


def test_gpu_profile_quick(tmp_path):
    # --quick is its --dry-run: a shrunk model on the CPU.
    text, data = run("gpu_profile", tmp_path, "--steps", "2", "--batches", "1", "--modes", "eager")
    assert all(case["step_ms"] > 0 and case["top"] for case in data["cases"])


def test_every_benchmark_is_run_quick_here():
    """Each module that runs on the harness has its --quick run above (or,
    for one that runs inside vLLM, in tests_vllm/, which its CI job runs)."""
    tests = [open(__file__).read()] + [open(os.path.join(ROOT, "tests_vllm", f)).read()
                                       for f in os.listdir(os.path.join(ROOT, "tests_vllm")) if f.endswith(".py")]
    for name in sorted(os.listdir(os.path.join(ROOT, "benchmarks"))):
        source = open(os.path.join(ROOT, "benchmarks", name)).read() if name.endswith(".py") else ""
        if re.search(r'^if __name__ == "__main__":\n(?:\s.*\n)*?\s+harness\.main\(', source, re.M):
            assert any(re.search(rf"def test_{name[:-3]}\w*_quick", t) for t in tests), name


def test_interleaved_takes_turns_in_rotating_order():
    order = []
    runs = harness.interleaved({n: (lambda n=n: order.append(n) or len(order)) for n in "abc"}, 3)
    assert "".join(order) == "abcbcacab"
    assert runs == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}
    assert harness.spread([3, 1, 2]) == {"median": 2, "low": 1, "high": 3, "runs": [3, 1, 2]}
    assert harness.ratios([2, 6], [1, 2])["median"] == 2.5


def test_a_ratio_against_vllm_pairs_each_round_with_itself():
    # Per round 2x, 2.4x and 2x: the median is 2x, where the fastest round
    # of each side (12 us, 5 us: rounds 2 and 2) says 2.4x; with other
    # data the fastest rounds come from different rounds altogether.
    from benchmarks.manager_overhead import round_ratio

    theirs = [{"us_per_admission": 20.0}, {"us_per_admission": 12.0}, {"us_per_admission": 40.0}]
    ours = [{"us_per_admission": 10.0}, {"us_per_admission": 5.0}, {"us_per_admission": 20.0}]
    assert round_ratio(theirs, ours, "us_per_admission") == 2.0


def test_lockstep_advances_the_variants_one_step_each_in_turn():
    order = []

    def steps(name, count):
        for i in range(count):
            order.append(f"{name}{i}")
            yield
        return f"{name} done"

    runs = harness.lockstep({"a": lambda: steps("a", 3), "b": lambda: steps("b", 1)}, 2)
    # Round one: a, b, a, b (b ends), a; round two starts with b.
    assert order == ["a0", "b0", "a1", "a2", "b0", "a0", "a1", "a2"]
    assert runs == {"a": ["a done", "a done"], "b": ["b done", "b done"]}
    assert harness.run_through(steps("c", 2)) == "c done"
    order.clear()
    harness.lockstep({"a": lambda: steps("a", 3), "b": lambda: steps("b", 3)}, 1, turn=2)
    assert order == ["a0", "a1", "b0", "b1", "a2", "b2"]


def test_the_environment_names_the_machine():
    env = harness.environment(threads=2)
    assert env["cpu"] and env["cores"] >= 1 and env["python"] and "torch" in env["packages"]
    assert f"{env['usable_cores']} cores" in harness.machine(env)
    assert harness.machine({"machine": "not recorded"}) == "not recorded"


def test_the_benchmarks_page_stays_a_report_of_the_current_state():
    # Figures, what they mean and the command that makes each: under 450
    # lines (history belongs to git; detail to the page of its subject).
    with open(render.PAGE) as f:
        assert len(f.read().splitlines()) < 450


def test_the_docs_tables_are_the_results_rendered():
    # docs/benchmarks.md's tables (and the README's and other pages') are what
    # benchmarks/render.py writes from benchmarks/results/; after a rerun,
    # `python -m benchmarks.render` rewrites them (and shows what changed).
    wrong = render.disagreements()
    assert not wrong, "".join(wrong[:60])


def test_a_figure_edited_by_hand_or_a_table_outside_the_markers_is_caught():
    with open(render.PAGE) as f:
        page = f.read()
    table = page.index("| Gemma-3-27B |", page.index("<!-- table manager -->"))
    cells = page[table:page.index("\n", table)].split(" | ")
    cells[2] = str(int(cells[2]) + 1)  # µs / admission
    edited = page[:table] + " | ".join(cells) + page[page.index("\n", table):]
    assert edited != page and render.render(edited) == page
    assert render.unmarked_tables(page) == []
    assert render.unmarked_tables(page + "\n| model | tok/s |\n|---|---|\n| x | 1 |\n") == [
        "| model | tok/s |", "|---|---|", "| x | 1 |"]
