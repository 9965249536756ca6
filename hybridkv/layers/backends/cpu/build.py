"""Building the CPU kernels (kernels.c) for this machine: hybridkv/core/native.py
builds them (at install time, or by `hybridkv build-kernels`; never inside
an Engine). This module names that library's parts for the backend, read
at each call (`FLAGS` and `PACKAGE_DIR` may be replaced, as the tests do).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ....core import native
from ....core.native import compiler  # noqa: F401  (the backend's messages and the tests ask here)

SOURCE = native.CPU_KERNELS.source
PACKAGE_DIR = native.CPU_KERNELS.package_dir  # install-time builds
FLAGS = list(native.CPU_KERNELS.flags)


def _library() -> native.NativeLibrary:
    return replace(native.CPU_KERNELS, flags=tuple(FLAGS), package_dir=PACKAGE_DIR)


def cache_dir() -> Path:
    """Builds made after install: `cpu-kernels/` under hybridkv's cache root
    (~/.cache/hybridkv, or $HYBRIDKV_CACHE)."""
    return _library().cache_dir()


def machine_key() -> str:
    return _library().machine_key()


def library_name() -> str:
    return _library().library_name()


def built_library() -> Path | None:
    """This machine's build of the current source, where one exists."""
    return _library().built_library()


def build_into(folder: Path, cc: str | None = None) -> Path:
    """Compile the kernels into `folder`; RuntimeError with the compiler's
    message, or when no compiler is found."""
    return _library().build_into(folder, cc)


def build(cc: str | None = None) -> Path:
    """Build into the package folder when writable, else the cache folder."""
    return _library().build(cc)
