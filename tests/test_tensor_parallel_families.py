"""Tensor parallelism for every family on the CPU: two real processes over
gloo, each with its share of the attention heads (gpt-oss's sinks with
them), the MLP and experts' width, the Mamba-2 heads and the groups they
read (fewer groups than ranks included: the gated norm's sums then cross
the ranks), the Gated DeltaNet key and value heads, the short
convolutions' channels. In one engine per family: a batch with prefix
hits, prefill in 16-token steps and a pool small enough to preempt, then
documents one at a time that evict each other into a host tier and come
back from it. Tokens equal the one process's (same options) and
transformers' argmax; every sampled row's logits the one process's."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.modeling.tensor_split import rank_config
from oracle import check_tokens, load_reference, model_dir, record_logits

FAMILIES = ["nemotron_h", "granite_hybrid", "bamba", "bamba_one_group", "falcon_h1", "lfm2", "qwen3_next", "qwen3_5",
            "gpt_oss"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def batch():
    shared = list(range(5, 40))
    return [shared + [41, 42], shared + [43], list(range(60, 90)), shared[:20] + list(range(100, 130)),
            list(range(150, 160)), shared + [44, 45, 46]]


def documents():
    docs = [[(11 * d + 5 * j) % 190 + 7 for j in range(44)] for d in range(3)]
    return docs + [d + [3, 4] for d in docs]


def run(path, tp, pages):
    # The same number of pages at either size (a rank's page holds half the heads and channels).
    probe = Engine(path, progress=False, kv_cache_memory="8MiB", block_size=4, max_model_len=256, dtype="float32")
    options = dict(kv_cache_memory=pages * probe.layout.page_size_bytes // tp, block_size=4, max_model_len=256,
                   max_num_batched_tokens=16, kv_host_cache_memory="1MiB", dtype="float32")
    engine = Engine(path, progress=False, tensor_parallel_size=tp, **options)
    rows = record_logits(engine)
    try:
        outs = engine.generate(batch(), GREEDY, use_tqdm=False)
        outs += [engine.generate([p], GREEDY, use_tqdm=False)[0] for p in documents()]
        return ([o.outputs[0].token_ids for o in outs], engine.stats,
                {(seq_id, position): row for seq_id, position, row in rows})
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_on_two_ranks_gives_the_one_process_tokens_and_logits(family, tmp_path_factory):
    path = model_dir(tmp_path_factory, family)
    probe = Engine(path, progress=False, kv_cache_memory="8MiB", block_size=4, max_model_len=256, dtype="float32")
    pages = 2 * probe.layout.pages_per_request(50, chunk=16) + 3  # room for about two requests at a time
    one, one_stats, one_rows = run(path, 1, pages)
    two, stats, two_rows = run(path, 2, pages)
    assert two == one
    reference = load_reference(path)
    for prompt, tokens in zip(batch() + documents(), two):
        check_tokens(reference, prompt, tokens)
    assert stats["preemptions"] > 0 and stats["prefix_hit_tokens"] > 0
    assert stats["kv_tier_loads_by_group"], "no hit came back from the host tier"
    shared = one_rows.keys() & two_rows.keys()
    assert len(shared) >= len(two_rows) - len(batch())  # (preemption may re-sample a few rows under other keys)
    for key in shared:
        torch.testing.assert_close(two_rows[key], one_rows[key], atol=1e-4, rtol=1e-4)


def test_sizes_that_do_not_divide_are_named(tmp_path_factory):
    from types import SimpleNamespace

    common = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, head_dim=16, intermediate_size=96)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide mamba_num_heads=3"):
        rank_config(SimpleNamespace(model_type="nemotron_h", **common, mamba_num_heads=3, mamba_head_dim=16,
                                    n_groups=1), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 and mamba_n_groups=6: one must divide"):
        rank_config(SimpleNamespace(model_type="bamba", **common, mamba_n_heads=12, mamba_d_head=16,
                                    mamba_n_groups=6), 4)
    with pytest.raises(ValueError, match="does not divide linear_num_key_heads=1"):
        rank_config(SimpleNamespace(model_type="qwen3_next", **common, linear_num_key_heads=1,
                                    linear_num_value_heads=2), 2)
    with pytest.raises(ValueError, match="does not divide moe_intermediate_size=30"):
        rank_config(SimpleNamespace(model_type="qwen3_next", **common, moe_intermediate_size=30,
                                    shared_expert_intermediate_size=32), 4)
    # the rank's view: what its cache holds
    view = rank_config(SimpleNamespace(model_type="bamba", **common, mamba_n_heads=8, mamba_d_head="auto",
                                       mamba_expand=2, mamba_n_groups=1), 2)
    assert (view.mamba_n_heads, view.mamba_d_head, view.mamba_n_groups, view.num_key_value_heads) == (4, 16, 1, 1)
