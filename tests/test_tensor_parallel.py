"""Tensor parallelism on the CPU (engine/tensor_parallel.py): two real
processes over gloo, each with its half of the heads, MLP width, Mamba
channels, experts' width and vocabulary, one manager in the driver. Greedy
outputs equal the one-process engine's and transformers' argmax, on Gemma-3
and Jamba, through prefix hits, chunked prefill, preemption in a tiny pool
and speculative decoding; a size that does not divide and a worker that
dies are errors, not hangs."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from oracle import check_tokens, load_reference, model_dir
from real_model import real_gguf_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    # Vocabulary 211: the two ranks hold 106 and 105 rows of the LM head.
    path = model_dir(tmp_path_factory, "gemma3", sliding_window=8)
    return path, load_reference(path)


def prompts():
    shared = list(range(5, 40))
    return [shared + [41, 42], shared + [43], list(range(60, 67)), shared[:20] + list(range(100, 130)),
            list(range(150, 152))]


def generate(path, tp, prompt_list=None, params=GREEDY, **options):
    engine = Engine(path, progress=False, tensor_parallel_size=tp, **options)
    try:
        outs = engine.generate(prompt_list or prompts(), params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], engine.stats, engine
    finally:
        engine.close()


def test_two_ranks_give_the_one_process_tokens_and_transformers_argmax(gemma3):
    path, reference = gemma3
    # Small steps (chunked prefill), the shared prompt hit from the cache.
    one, _, _ = generate(path, 1, max_num_batched_tokens=16)
    two, stats, engine = generate(path, 2, max_num_batched_tokens=16)
    assert two == one
    for prompt, tokens in zip(prompts(), two):
        check_tokens(reference, prompt, tokens)
    assert stats["prefix_hit_tokens"] > 0
    assert engine.executor.steps == engine.num_steps  # every step went to the worker as one plan
    assert len(engine.executor.workers) == 1 and engine.tables.kv is engine.kv  # one manager, the driver's


def test_two_ranks_run_decode_steps_on_the_fixed_shape_path_as_one_process_does(gemma3):
    # Every rank's worker takes the same route from the same plan: the padded
    # fixed-shape decode step (the path CUDA graphs capture) on both ranks, so
    # their all-reduces agree in shape.
    path, _ = gemma3
    one, _, _ = generate(path, 1, fixed_shape_decode=True)
    two, stats, engine = generate(path, 2, fixed_shape_decode=True)
    assert two == one
    routes = stats["backend"]["routes"]
    assert sum(n for route, n in routes.items() if route.endswith(":fixed-shape")) >= GREEDY.max_tokens - 2


def test_preemption_and_speculative_decoding_on_two_ranks(gemma3):
    path, _ = gemma3
    many = [list(range(10 + 3 * i, 40 + 3 * i)) for i in range(8)]
    longer = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ample, _, engine = generate(path, 1, many, longer)
    # Room for about two requests at full length.
    pages = 2 * engine.layout.pages_per_request(60, chunk=16) + 3
    small = dict(kv_cache_memory=pages * engine.layout.page_size_bytes, max_num_batched_tokens=16)
    got, stats, _ = generate(path, 2, many, longer, **small)
    assert stats["preemptions"] > 0 and got == ample
    spec, stats, _ = generate(path, 2, many, longer, speculative_method="ngram", num_speculative_tokens=3)
    assert spec == ample and stats["spec_draft_tokens"] > 0


def test_sizes_that_do_not_divide_are_refused(gemma3):
    # (every family splits: tests/test_tensor_parallel_families.py; their sizes there)
    path, _ = gemma3
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        Engine(path, progress=False, tensor_parallel_size=3)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory):
    path = model_dir(tmp_path_factory, "jamba")
    return path, load_reference(path)


def test_jamba_splits_its_mamba_channels_and_experts_over_two_ranks(jamba, monkeypatch):
    # Mamba states per rank (its channels), experts split by width, prefix
    # hits from Mamba checkpoints, chunked prefill, and speculative decoding,
    # whose rollback of the Mamba state the workers apply from the next plan.
    path, reference = jamba
    # 16-token blocks: these short prompts share less than the planner's 64 for recurrent models.
    one, _, _ = generate(path, 1, max_num_batched_tokens=16, block_size=16)
    two, stats, _ = generate(path, 2, max_num_batched_tokens=16, block_size=16)
    assert two == one and stats["prefix_hit_tokens"] > 0
    for prompt, tokens in zip(prompts(), two):
        check_tokens(reference, prompt, tokens)
    # Drafts the model rejects (this tiny model follows every repetition, so
    # prompt lookup's own drafts would all be kept): each verified step then
    # rolls the Mamba states back, and the workers must do the same.
    from hybridkv.engine import speculative

    monkeypatch.setattr(speculative.PromptLookup, "propose", lambda self, tokens, k: [(tokens[-1] * 7 + 3) % 211] * k)
    # This tiny model's argmax is too robust to show a wrong state in its
    # tokens, so every step's logits are compared with the one-process run's.
    longer = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain, _, _ = generate(path, 1, params=longer, block_size=16)
    logits = []
    for tp in (1, 2):
        engine = Engine(path, progress=False, tensor_parallel_size=tp, speculative_method="ngram",
                        num_speculative_tokens=3, block_size=16)
        seen, execute = [], engine.executor.execute
        engine.executor.execute = lambda plan: seen.append(execute(plan)) or seen[-1]
        try:
            spec = [o.outputs[0].token_ids for o in engine.generate(prompts(), longer, use_tqdm=False)]
        finally:
            engine.close()
        assert spec == plain
        logits.append(seen)
    stats = engine.stats
    assert stats["spec_draft_tokens"] > 20 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"] / 2
    assert len(logits[0]) == len(logits[1])
    for one_step, two_step in zip(*logits):
        torch.testing.assert_close(two_step, one_step, atol=1e-4, rtol=1e-4)


def test_a_worker_that_dies_fails_the_engine_instead_of_hanging(gemma3):
    path, _ = gemma3
    engine = Engine(path, progress=False, tensor_parallel_size=2)
    try:
        engine.generate([list(range(5, 20))], SamplingParams(max_tokens=2), use_tqdm=False)
        worker = engine.executor.workers[0]
        worker.kill()
        worker.join(10)
        with pytest.raises(RuntimeError, match="worker hybridkv-tp-1 exited"):
            engine.generate([list(range(5, 20))], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        engine.close()


STARTING = """
import sys, time, torch
from hybridkv.engine.tensor_parallel import TensorParallelExecutor
start = time.monotonic()
try:
    executor = TensorParallelExecutor(2, sys.argv[1], eval(sys.argv[2]), torch.device("cpu"), timeout=60)
    executor.wait_until_loaded()
except RuntimeError as error:
    print(f"ERROR after {time.monotonic() - start:.1f} s: {error}")
else:
    executor.close()
    print("STARTED")
"""


@pytest.mark.parametrize("case,options,stage", [
    # The worker fails before it joins the group (its first call refuses the option).
    ("before joining", {"threads": "two"}, "joined"),
    # It joins, then its shard does not load: the folder is not a model.
    ("loading its shard", {"device": "cpu", "dtype": "float32"}, "loaded"),
])
def test_a_worker_that_dies_while_starting_fails_the_start_at_once(gemma3, tmp_path, case, options, stage):
    import subprocess
    import sys

    # A process of its own, with the group's timeout at 60 s: were the driver
    # to wait out the timeout, the message would say so and the test fail.
    folder = str(tmp_path) if case == "loading its shard" else gemma3[0]
    done = subprocess.run([sys.executable, "-c", STARTING, folder, repr(options)], capture_output=True, text=True,
                          timeout=180)
    out = done.stdout.strip().splitlines()[-1]
    assert out.startswith("ERROR"), done.stdout + done.stderr[-2000:]
    assert f"worker hybridkv-tp-1 exited (code 1) while starting (before it had {stage})" in out
    assert float(out.split()[2]) < 30, out


def test_each_rank_reads_only_its_slices(gemma3):
    from hybridkv.modeling.loader import load_model

    path, _ = gemma3
    full, _ = load_model(path, progress=False)
    for rank in (0, 1):
        part, config = load_model(path, progress=False, tensor_parallel=(rank, 2))
        assert config.num_attention_heads == 2 and config.intermediate_size == 48
        attention, whole = part.model.layers[0].self_attn, full.model.layers[0].self_attn
        q = whole.qkv_proj.weight[:64]  # 4 heads x 16
        torch.testing.assert_close(attention.qkv_proj.weight[:32], q[32 * rank:32 * (rank + 1)])
        torch.testing.assert_close(part.model.layers[0].mlp.down_proj.weight,
                                   full.model.layers[0].mlp.down_proj.weight[:, 48 * rank:48 * (rank + 1)])
        rows = slice(0, 106) if rank == 0 else slice(106, 211)
        torch.testing.assert_close(part.lm_head.weight, full.model.embed_tokens.weight[rows])


def test_the_real_gemma3_270m_on_two_ranks():
    path = real_gguf_path()
    # One KV head: each rank holds it whole, and 2 of the 4 query heads.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = ["The library of the city keeps", "Rain fell on the harbour while"]
    got = []
    for tp in (1, 2):
        engine = Engine(path, progress=False, tensor_parallel_size=tp, kv_cache_memory="64MiB")
        try:
            got.append([o.outputs[0].token_ids for o in engine.generate(texts, params, use_tqdm=False)])
        finally:
            engine.close()
    assert got[0] == got[1]


def test_the_server_serves_a_two_rank_engine_and_stops_its_worker(gemma3):
    import httpx

    from hybridkv.server import build_app
    from serving import running

    path, _ = gemma3
    body = {"prompt": list(range(5, 30)), "max_tokens": 14, "temperature": 0, "ignore_eos": True}
    texts = []
    for tp in (1, 2):
        engine = Engine(path, progress=False, tensor_parallel_size=tp)
        workers = getattr(engine.executor, "workers", [])
        with running(build_app(engine, model_name="m")) as url:
            out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 14
        texts.append(out["choices"][0]["text"])
        for worker in workers:  # the app's shutdown closed the engine, and the engine its worker
            worker.join(30)
            assert not worker.is_alive()
    assert texts[0] == texts[1]
