"""hybridkv's KV connector inside real vLLM (CPU build) on the real
Gemma-3 270M (15 sliding-window layers, window 512, and 3 full-attention
layers), with a prompt longer than the window: blocks restored from host
memory, from disk, and after a restart over the same directory give the
cold run's tokens and logprobs; so do blocks a producer vLLM wrote for a
consumer vLLM (prefill and decode on two engines)."""

from __future__ import annotations

import pytest
from conftest import max_logprob_diff

CLOSE = 1e-3  # logprobs of a 262k-token vocabulary, the tail computed in another shape


@pytest.fixture(scope="module")
def prompt(real_gemma3) -> list[int]:
    from transformers import AutoTokenizer

    from hybridkv.demo_texts import HISTORY, SYSTEM

    ids = AutoTokenizer.from_pretrained(real_gemma3).encode(SYSTEM + HISTORY)
    assert len(ids) >= 700
    return ids[:700]


def test_real_gemma3_host_disk_and_restart_equal_a_cold_run(serve, real_gemma3, prompt, tmp_path):
    disk = str(tmp_path / "kv")
    vllm = serve(real_gemma3, {"host_memory": "512MiB", "disk_dir": disk})
    kinds = vllm.tiers.groups.kinds
    assert kinds.count("full") >= 1 and kinds.count("sliding_window") >= 1
    cold = vllm.generate(prompt, max_tokens=8)
    pool = vllm.generate(prompt, max_tokens=8)
    vllm.drop_pool_cache()
    host = vllm.generate(prompt, max_tokens=8)
    assert host[2] == 672  # 699 // 32 whole blocks
    assert host[0] == cold[0] and max_logprob_diff(host[1], cold[1]) < CLOSE
    assert host[0] == pool[0] and host[1] == pool[1]
    # The first run computed 707 tokens: a full-attention group keeps all 22
    # whole blocks, a sliding-window group its last window at 704 (16
    # blocks) and the block before it, which the window at the prompt's end
    # (672) reads too, stored from vLLM's cached copy.
    for kind, keys in zip(kinds, vllm.tiers.held):
        assert len(keys) == (22 if kind == "full" else 17), (kind, len(keys))
    assert vllm.generate(prompt, max_tokens=8, salt="another-tenant")[2] == 0
    vllm.close()  # host memory goes to disk
    restarted = serve(real_gemma3, {"disk_dir": disk})
    again = restarted.generate(prompt, max_tokens=8)
    assert again[2] == 672
    assert again[0] == cold[0] and max_logprob_diff(again[1], cold[1]) < CLOSE
    assert again[0] == pool[0] and again[1] == pool[1]


def test_real_gemma3_prefill_on_one_vllm_decode_on_another(serve, real_gemma3, prompt, tmp_path):
    # Two vLLMs (kv_role kv_producer, then kv_consumer) over one directory:
    # the producer computes the prompt (one token) and writes, in the step
    # that computes them, the blocks a hit on it reads (every full-attention
    # block, the windows' last blocks); the consumer loads them and answers
    # as vLLM alone does.
    disk = str(tmp_path / "kv")
    producer = serve(real_gemma3, {"disk_dir": disk}, kv_role="kv_producer")
    producer.generate(prompt, max_tokens=1)
    stats = producer.tiers.stats
    assert stats["stores_prefilled"] > 0 and stats["stores_finished"] == 0
    consumer = serve(real_gemma3, {"disk_dir": disk}, kv_role="kv_consumer")
    decoded = consumer.generate(prompt, max_tokens=8)
    assert decoded[2] == 672  # 699 // 32 whole blocks, from the producer's files
    alone = serve(real_gemma3).generate(prompt, max_tokens=8)
    assert decoded[0] == alone[0] and max_logprob_diff(decoded[1], alone[1]) < CLOSE
