"""Tensor parallelism as parallel layers (layers/parallel.py): each rank's
model holds its part in column- and row-parallel linear layers and a
vocabulary-parallel LM head, which read their own slices of the checkpoint
and sum or gather across the ranks in their forward. So every rank runs
the same backend route as one process would: on the cpu backend, decode
steps of up to three rows go through the C decoder layers on both ranks
(three C calls per layer, the partial sums all-reduced between them), and
of four through their stages (the modules' products and all-reduces
between them), and the tokens are the one process's on every family that
splits."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine, SamplingParams
from hybridkv.layers.backends.cpu import build
from hybridkv.layers.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelHead
from hybridkv.modeling.loader import load_model
from oracle import model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(5, 40)) + [41], list(range(5, 40)) + [43], list(range(60, 67)), [150, 151]]


def generate(path, tp, **options):
    engine = Engine(path, progress=False, tensor_parallel_size=tp, **options)
    try:
        tokens = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return tokens, engine.stats["backend"]
    finally:
        engine.close()


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("family", ["gemma3", "gemma2", "mistral"])
def test_two_ranks_take_the_one_process_route_through_the_c_decoder_layers(tmp_path_factory, family):
    # Gemma-3: q/k norms and post norms around both sublayers (the sums are
    # normed after the all-reduce); Gemma-2: soft-capped attention;
    # Mistral (Llama's code): no post norms, SiLU.
    path = model_dir(tmp_path_factory, family)
    one, one_backend = generate(path, 1, backend="cpu", max_num_batched_tokens=16)
    two, two_backend = generate(path, 2, backend="cpu", max_num_batched_tokens=16)
    assert two == one
    assert one_backend["routes"]["cpu:decoder-layers"] > 0 and one_backend["routes"]["cpu:decoder-stages"] > 0
    assert two_backend["routes"] == one_backend["routes"]
    assert not any("decoder layers" in why for why in two_backend["declined"])


def test_jamba_ranks_hold_their_channels_heads_and_expert_widths(tmp_path_factory):
    # Loaded without processes: only the slicing, which each module asks of the loader.
    path = model_dir(tmp_path_factory, "jamba")
    full, _ = load_model(path, progress=False)
    inner = 64  # mamba_expand 2 x hidden 32; the experts are 64 wide too
    for rank in (0, 1):
        part, config = load_model(path, progress=False, tensor_parallel=(rank, 2))
        assert config.mamba_inner == inner // 2 and config.num_key_value_heads == 1
        mine = slice(32 * rank, 32 * (rank + 1))  # of the channels, and of an expert's width
        mamba, whole = part.model.layers[0].mamba, full.model.layers[0].mamba
        assert isinstance(mamba.in_proj, ColumnParallelLinear) and isinstance(mamba.out_proj, RowParallelLinear)
        x_rows, gate_rows = whole.in_proj.weight[:inner], whole.in_proj.weight[inner:]
        torch.testing.assert_close(mamba.in_proj.weight, torch.cat([x_rows[mine], gate_rows[mine]]))
        for name in ("A_log", "D"):
            torch.testing.assert_close(getattr(mamba, name), getattr(whole, name)[mine])
        torch.testing.assert_close(mamba.conv1d.weight, whole.conv1d.weight[mine])
        torch.testing.assert_close(mamba.dt_proj.weight, whole.dt_proj.weight[mine])
        torch.testing.assert_close(mamba.x_proj.weight, whole.x_proj.weight[:, mine])
        torch.testing.assert_close(mamba.out_proj.weight, whole.out_proj.weight[:, mine])
        expert = part.model.layers[1].feed_forward.experts[2]
        torch.testing.assert_close(expert.down_proj.weight,
                                   full.model.layers[1].feed_forward.experts[2].down_proj.weight[:, mine])
        assert not expert.down_proj.reduce  # the mixture sums its experts, then reduces once
        attention = part.model.layers[1].self_attn
        k = full.model.layers[1].self_attn.qkv_proj.weight[32:48]  # after q's 4 heads x 8: k's 2 heads
        torch.testing.assert_close(attention.qkv_proj.weight[16:24], k[8 * rank:8 * (rank + 1)])  # its one KV head
        assert isinstance(part.lm_head, VocabParallelHead) and part.lm_head.weight.shape[0] == (106, 105)[rank]


def test_one_rank_builds_the_plain_layers():
    # Outside a tensor-parallel build every layer holds the whole weight and
    # its forward is the plain product: no collective is reached.
    layer = RowParallelLinear(6, 4, bias=True)
    head = VocabParallelHead(4, 9)
    x = torch.randn(3, 6)
    assert layer.weight.shape == (4, 6) and layer.bias is not None and head.weight.shape == (9, 4)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.checkpoint_part("weight", 2) is None and head.checkpoint_part("weight", 2) is None
