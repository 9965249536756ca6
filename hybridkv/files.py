"""Where hybridkv keeps files it builds for the user: the built-in tiny
models, the Hugging Face folders converted from GGUF checkpoints and the C
libraries built after install.

`HYBRIDKV_CACHE` overrides the default `~/.cache/hybridkv`. The rule lives
with the C builds (core/native.py), the lowest floor, which setup.py runs
alone."""

from __future__ import annotations

from .core.native import cache_root

__all__ = ["cache_root"]
