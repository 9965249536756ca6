"""Narrow KV pages on the real weights: the engine in float32 on the real
Gemma-3 270M, teacher-forced over ~1,200 positions of varied text (prose
past the 512-token window, the Python reference manual), with int8 and
fp8_e4m3 pages on every attention layer, against the same engine with
float32 pages: the text's perplexity moves by under 1% with int8, under 3%
with fp8_e4m3 (the goals), and the argmax at each position (from the
prompt logprobs) stays the float pages' on at least 98.7% of positions
with int8 (99.2% measured here with the keys less their layer's centre;
98.5% before it, 95.9% before the rotation) and 95% with fp8_e4m3
(97.0%): a change that loses the centre or the rotation fails
(benchmarks/kv_dtypes.py measures ~20,000 positions: docs/kv_dtypes.md)."""

from __future__ import annotations

import math

import pytest

from hybridkv import Engine, SamplingParams
from real_model import real_gguf_path

TOKENS = 600  # of each text
LIMITS = {"int8": (0.987, 0.01), "fp8_e4m3": (0.95, 0.03)}  # top-1 agreement at least, perplexity change under


@pytest.fixture(scope="module")
def runs():
    from benchmarks.kv_dtypes import texts
    from benchmarks.real_gemma3 import tokenizer

    gguf = real_gguf_path()
    tok = tokenizer()
    prompts = [[2] + tok.encode(t, add_special_tokens=False)[:TOKENS - 1] for t in texts()[:3:2]]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = {}
    for pages in ("auto", *LIMITS):
        engine = Engine(gguf, dtype="float32", kv_cache_dtype=pages, kv_cache_memory="64MiB",
                        max_num_batched_tokens=512, enable_prefix_caching=False, progress=False)
        top, logprobs = [], []
        for prompt, result in zip(prompts, engine.generate(prompts, params, use_tqdm=False)):
            for position, entry in enumerate(result.prompt_logprobs[1:], 1):  # none before the first token
                top.append(list(entry)[-1])  # the prompt's token first, then the top one (one key if the same)
                logprobs.append(entry[prompt[position]])
        out[pages] = top, math.exp(-sum(logprobs) / len(logprobs))
        del engine
    return out


@pytest.mark.parametrize("pages", list(LIMITS))
def test_narrow_pages_keep_the_float_pages_argmax_and_perplexity(runs, pages):
    top, ppl = runs[pages]
    base_top, base_ppl = runs["auto"]
    agreement = sum(a == b for a, b in zip(top, base_top)) / len(base_top)
    change = ppl / base_ppl - 1.0
    print(f"{pages}: {len(top)} positions, top-1 {100 * agreement:.2f}%, perplexity {ppl:.3f} "
          f"({100 * change:+.2f}%)")
    assert len(top) >= 1100
    minimum, most = LIMITS[pages]
    assert agreement >= minimum and abs(change) < most
