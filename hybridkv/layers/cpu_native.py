"""hybridkv's C kernels for the CPU (cpu_kernels.c): built on first use with
the system's C compiler, kept in a cache directory, loaded through ctypes.

Why C and not a torch extension: the source includes no torch header, so it
builds in about a second where a torch extension takes most of a minute,
and the library loads in any torch. Why build here and not ship a binary:
`-march=native` gives the machine's own vector width (AVX2, AVX-512, NEON:
whatever the CPU has).

`library()` gives the loaded library, or None where there is no compiler,
the build fails or `HYBRIDKV_NATIVE=0`; callers then keep the torch
reference. The build runs once per source, compiler and machine: the
library's name carries a hash of the three, and a finished build is
renamed into place, so processes starting together never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from ..files import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# Reassociating float sums lets the compiler vectorise the dot products;
# no -ffast-math: it would also assume no infinities or NaNs.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-shared", "-fPIC", "-std=c11"]

_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    """Where built libraries are kept: `native/` under hybridkv's cache
    root (files.py: ~/.cache/hybridkv, or $HYBRIDKV_CACHE)."""
    return Path(cache_root()) / "native"


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cc: str, target: Path) -> None:
    """Compile the source into `target` (raises CalledProcessError with the
    compiler's message on failure)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", partial, "-lm"], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                                     f32, f32, ptr, ctypes.c_int]
    lib.norm_rotary.restype = None
    lib.norm_rotary.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, f32, f32, ptr, ptr, ptr, ctypes.c_int]
    lib.gated_activation.restype = None
    lib.gated_activation.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    lib.decode_layer.restype = ctypes.c_int
    lib.decode_layer.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr,
                                 ctypes.c_int]
    return lib


def library() -> ctypes.CDLL | None:
    """The built and loaded kernels, or None (see the module docstring)."""
    if os.environ.get("HYBRIDKV_NATIVE", "1") == "0":
        return None
    key = str(cache_dir())
    if key in _loaded:
        return _loaded[key]
    lib = None
    cc = compiler()
    if cc is not None:
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _version(cc).encode() +
                                platform.machine().encode() + _cpu_flags().encode()).hexdigest()[:16]
        target = cache_dir() / f"cpu_kernels-{digest}.so"
        try:
            if not target.exists():
                build(cc, target)
            lib = _declare(ctypes.CDLL(str(target)))
        except subprocess.CalledProcessError as error:
            warnings.warn(f"hybridkv: building the CPU kernels failed ({error.stderr.strip()[-500:]}); "
                          f"using the torch reference", RuntimeWarning, stacklevel=2)
        except (OSError, subprocess.SubprocessError) as error:
            warnings.warn(f"hybridkv: the CPU kernels could not be built or loaded ({error}); "
                          f"using the torch reference", RuntimeWarning, stacklevel=2)
    _loaded[key] = lib
    return lib


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), so that a cache directory shared by
    machines of different CPUs keeps one build per CPU (-march=native)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()
