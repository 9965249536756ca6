"""The real Gemma-3 270M (GGUF, Q4_K_M, from the `gemma` extra) served by
hybridkv.Engine straight from its .gguf file, against transformers' own GGUF
path on the same file (what that path built is kept on disk,
tests/real_model.py), float32: greedy tokens identical for a batch with a
prompt longer than the 512-token window, after a prefix-cache hit longer
than the window, under chunked prefill and under preemption.

CI installs the extra and sets HYBRIDKV_REQUIRE_REAL_MODEL=1, so there a
missing model fails instead of skipping.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.demo_texts import HISTORY, LONG_QUESTIONS, QUESTIONS, SYSTEM, long_prompt, question_prompt, quoting_prompt
from real_model import real_gguf_path, transformers_gguf_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
WINDOW = 512


@pytest.fixture(scope="module")
def gguf_path():
    return real_gguf_path()


@pytest.fixture(scope="module")
def reference(gguf_path):
    """transformers' Gemma3ForCausalLM loaded by transformers from the same
    .gguf file, and its greedy continuations (memoised per prompt)."""
    model = transformers_gguf_model(gguf_path)
    memo: dict[tuple, list[int]] = {}

    def greedy(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in memo:
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            memo[key] = out[0, len(ids):].tolist()
        return memo[key]

    return greedy


@pytest.fixture(scope="module")
def engine(gguf_path):
    return Engine(gguf_path, kv_cache_memory="256MiB", progress=False)


def token_ids(engine, texts):
    return [engine.tokenizer.encode(t) for t in texts]


def generate(engine, prompts):
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def test_gguf_engine_reads_config_and_tokenizer_from_the_file(engine):
    config = engine.config
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 18
    assert config.sliding_window == WINDOW and config.vocab_size == 262144
    kinds = sorted(g.kind for g in engine.layout.groups)
    assert kinds == ["full", "sliding_window"]
    assert engine.tokenizer.encode("Hello world")[0] == engine.tokenizer.bos_token_id


def test_hybrid_real_gemma3_batch_matches_transformers(engine, reference):
    texts = [question_prompt(q) for q in QUESTIONS[:3]] + [long_prompt(LONG_QUESTIONS[0]), "def fibonacci(n):"]
    prompts = token_ids(engine, texts)
    assert max(len(p) for p in prompts) > WINDOW + 200, "one prompt must cross the sliding window"
    got, _ = generate(engine, prompts)
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(prompt)


def test_hybrid_real_gemma3_prefix_hit_longer_than_the_window(engine, reference):
    first, second = token_ids(engine, [long_prompt(q) for q in LONG_QUESTIONS])
    generate(engine, [first])  # caches the shared system prompt + history
    got, outs = generate(engine, [second])
    assert outs[0].metrics.num_cached_tokens > WINDOW + 128
    assert got[0] == reference(second)


def test_hybrid_real_gemma3_chunked_prefill_and_preemption(gguf_path, engine, reference):
    prompts = token_ids(engine, [long_prompt(LONG_QUESTIONS[1])] + [question_prompt(q) for q in QUESTIONS[3:6]])
    layout = engine.layout
    chunk = 96
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    # Room for the longest request and a little more: the batch cannot run at once.
    pages = layout.pages_per_request(longest, chunk=chunk) + 8
    small = Engine(gguf_path, kv_cache_memory=(pages + 2) * layout.page_size_bytes, max_num_batched_tokens=chunk,
                   progress=False)
    got, outs = generate(small, prompts)
    assert small.stats["preemptions"] > 0
    assert small.num_steps > len(prompts[0]) // chunk  # the long prompt took several chunks
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference(prompt)
    assert small.kv.num_free_pages == small.kv.num_total_pages


def test_real_gemma3_text_prompt_gives_text(engine):
    out = engine.generate(question_prompt("Where are the poetry books?"),
                          SamplingParams(temperature=0.0, max_tokens=12, stop=["\n"]), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert text.strip() and "\n" not in text
    assert SYSTEM.startswith("The following") and HISTORY  # the shared texts the demo prints from


def test_real_gemma3_served_over_http(engine):
    # `hybridkv serve --model x.gguf`: completions as Engine.generate gives
    # them; chat is a clear 400 since this base model's GGUF has no template.
    import openai

    from hybridkv.server import build_app
    from serving import running

    app = build_app(engine, model_name="gemma-3-270m-q4_k_m")
    prompt = question_prompt("Where are the poetry books?")
    expected = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    with running(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        done = client.completions.create(model="gemma-3-270m-q4_k_m", prompt=prompt, max_tokens=8, temperature=0)
        assert done.choices[0].text == expected.outputs[0].text
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="gemma-3-270m-q4_k_m", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hello"}])


def test_hybrid_real_gemma3_speculative_decoding_keeps_greedy_tokens(gguf_path, engine, reference):
    # Prompt lookup on a quoting prompt (drafts mostly right) and on a long
    # prompt past the window followed by a prefix hit (drafts often wrong):
    # the tokens of plain decoding, and transformers' for the first ten.
    spec = Engine(gguf_path, kv_cache_memory="256MiB", progress=False, speculative_method="ngram",
                  num_speculative_tokens=4)
    prompts = token_ids(engine, [quoting_prompt(), long_prompt(LONG_QUESTIONS[0]), long_prompt(LONG_QUESTIONS[1])])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in prompts:
        plain = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        got = spec.generate([prompt], params, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == plain
        assert plain[:MAX_TOKENS] == reference(prompt)
    assert got.metrics.num_cached_tokens > WINDOW  # the third prompt hit the second's prefix
    stats = spec.stats
    assert stats["spec_accepted_tokens"] > 20 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert stats["steps"] < 3 * 40  # fewer steps than tokens
    assert spec.kv.num_free_pages == spec.kv.num_total_pages


def test_hybrid_real_gemma3_disk_tier_hit_after_a_restart_matches_transformers(gguf_path, engine, reference, tmp_path):
    # A prompt past the window (so the window group's hit reads only its last
    # window): served, the engine stopped, a new one over the same directory
    # takes the prefix from disk, and its tokens equal transformers'.
    first, second = token_ids(engine, [long_prompt(q) for q in LONG_QUESTIONS])
    before = Engine(gguf_path, kv_cache_memory="256MiB", progress=False, kv_disk_cache=str(tmp_path))
    generate(before, [first])
    before.close()
    del before
    after = Engine(gguf_path, kv_cache_memory="256MiB", progress=False, kv_disk_cache=str(tmp_path))
    got, outs = generate(after, [second])
    assert outs[0].metrics.num_cached_tokens > WINDOW + 128
    assert sum(after.stats["kv_tier_loads_by_group"]["disk"]) > 0
    assert got[0] == reference(second)


def test_hybrid_real_gemma3_prefill_and_decode_engines_match_transformers(gguf_path, engine, reference, tmp_path):
    # Prefill and decode on different engines (kv_role) over one directory:
    # a prompt past the window computed by the prefill engine, continued by
    # the decode engine from what it shipped: every full-attention block,
    # the window group's last window only.
    prompt = token_ids(engine, [long_prompt(LONG_QUESTIONS[1])])[0]
    assert len(prompt) > WINDOW + 128
    prefill = Engine(gguf_path, kv_cache_memory="256MiB", progress=False, kv_disk_cache=str(tmp_path),
                     kv_role="prefill")
    decode = Engine(gguf_path, kv_cache_memory="256MiB", progress=False, kv_disk_cache=str(tmp_path),
                    kv_role="decode")
    first = prefill.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    got, outs = generate(decode, [prompt])
    assert got[0] == reference(prompt)
    assert outs[0].metrics.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    shipped, everything = first.metrics.kv_handoff_bytes, first.metrics.kv_all_layers_bytes
    assert shipped < 0.85 * everything  # 15 of 18 layers ship their last 512 tokens only
    assert sum(decode.stats["kv_tier_loads_by_group"]["disk"]) > 0 and decode.stats["kv_tier_failed_loads"] == 0
