"""Where hybridkv keeps files it builds for the user: the built-in tiny
models and the Hugging Face folders converted from GGUF checkpoints.

`HYBRIDKV_CACHE` overrides the default `~/.cache/hybridkv`."""

from __future__ import annotations

import os


def cache_root() -> str:
    return os.environ.get("HYBRIDKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hybridkv"))
