"""What `dtype` means on each device (layers/dtypes.py `choose_dtype`):
"auto" on the CPU is bfloat16 where the CPU computes it natively, float32
elsewhere, whatever the checkpoint holds; on an accelerator, the
checkpoint's. None reads $HYBRIDKV_DTYPE. The engine says what it chose
and why in its stats."""

from __future__ import annotations

import pytest
import torch

from hybridkv import Engine
from hybridkv.layers.dtypes import ENVIRONMENT, choose_dtype, native_bfloat16_flag
from hybridkv.tiny_models import tiny_model_dir

EPYC = "flags\t\t: fpu vme sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 vpclmulqdq\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
NO_BF16 = "flags\t\t: fpu vme sse2 avx2 avx512f avx512bw avx512_vnni\n"
GRAVITON3 = "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp bf16 i8mm sve\n"


@pytest.mark.parametrize("flags, expected", [(EPYC, torch.bfloat16), (SAPPHIRE_RAPIDS, torch.bfloat16),
                                             (GRAVITON3, torch.bfloat16), (NO_BF16, torch.float32)],
                         ids=["avx512_bf16", "amx", "arm-bf16", "none"])
def test_auto_on_the_cpu_is_bfloat16_only_where_the_cpu_computes_it(flags, expected):
    for checkpoint in (torch.float32, "bfloat16", None):  # whatever the checkpoint holds
        dtype, why = choose_dtype("auto", "cpu", checkpoint, flags=flags)
        assert dtype == expected and why.startswith("auto")
    assert ("natively" in why) == (expected == torch.bfloat16)


def test_auto_on_a_gpu_is_the_checkpoints_dtype():
    assert choose_dtype("auto", "cuda", "bfloat16", flags=NO_BF16)[0] == torch.bfloat16
    assert choose_dtype("auto", "cuda", torch.float16, flags=EPYC)[0] == torch.float16
    assert choose_dtype("auto", "cuda", None, flags=EPYC)[0] == torch.float32


def test_an_asked_dtype_wins_and_none_reads_the_environment(monkeypatch):
    assert choose_dtype("float32", "cpu", flags=EPYC) == (torch.float32, "asked for")
    assert choose_dtype("bf16", "cpu", flags=NO_BF16)[0] == torch.bfloat16  # a slow choice, but the user's
    monkeypatch.setenv(ENVIRONMENT, "float16")
    assert choose_dtype(None, "cpu", flags=EPYC) == (torch.float16, f"${ENVIRONMENT}")
    monkeypatch.setenv(ENVIRONMENT, "int3")
    with pytest.raises(ValueError, match=f"got 'int3' \\(from \\${ENVIRONMENT}\\)"):
        choose_dtype(None, "cpu")
    monkeypatch.delenv(ENVIRONMENT)
    assert choose_dtype(None, "cpu", flags=NO_BF16)[0] == torch.float32


def test_the_engine_loads_the_dtype_auto_picks_here_and_says_why(monkeypatch):
    monkeypatch.delenv(ENVIRONMENT, raising=False)
    path = tiny_model_dir("tiny-gemma3")  # a float32 checkpoint
    engine = Engine(path, kv_cache_memory="8MiB", progress=False)
    native = native_bfloat16_flag()
    expected = torch.bfloat16 if native else torch.float32
    assert {p.dtype for p in engine.model.parameters()} == {expected}
    assert engine.stats["dtype"]["weights"] == str(expected).removeprefix("torch.")
    assert (native or "no native bfloat16") in engine.stats["dtype"]["why"]
    assert {g.spec.dtype for g in engine.layout.groups} == {str(expected).removeprefix("torch.")}
    outs = engine.generate([[5, 6, 7]], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) > 0
