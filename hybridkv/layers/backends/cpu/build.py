"""Building the CPU kernels (kernels.c) for this machine: at install time
(setup.py runs `build_into` where a compiler exists) or by `hybridkv
build-kernels`; never inside an Engine. Standard library only, so that
setup.py can run it before torch is installed.

Why build here rather than ship a binary: `-march=native` gives the
machine's own vector width, which the decode figures depend on. A library
is named by a key of the source, the flags, the architecture and the CPU's
feature flags (`machine_key`), so a package folder or cache shared by
machines of different CPUs keeps one build per CPU and never loads one
built for another (which could die on an illegal instruction). A finished
build is renamed into place, so processes starting together never load
half a file.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
PACKAGE_DIR = Path(__file__).with_name("_built")  # install-time builds
# Reassociating float sums lets the compiler vectorise the dot products;
# no -ffast-math: it would also assume no infinities or NaNs.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-shared", "-fPIC", "-std=c11"]


def cache_dir() -> Path:
    """Builds made after install: `native/` under hybridkv's cache root
    (~/.cache/hybridkv, or $HYBRIDKV_CACHE)."""
    from ....files import cache_root  # here, not above: setup.py runs this file alone

    return Path(cache_root()) / "native"


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def machine_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + platform.machine().encode() +
                            cpu_flags().encode())
    return digest.hexdigest()[:16]


def library_name() -> str:
    return f"kernels-{machine_key()}.so"


def built_library() -> Path | None:
    """This machine's build of the current source, where one exists."""
    name = library_name()
    for folder in (PACKAGE_DIR, cache_dir()):
        if (folder / name).is_file():
            return folder / name
    return None


def build_into(folder: Path, cc: str | None = None) -> Path:
    """Compile the source into `folder` (made if missing); returns the
    library's path. Raises RuntimeError with the compiler's message, or
    when no compiler is found."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / library_name()
    fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", partial, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {done.stderr.strip()[-800:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def build(cc: str | None = None) -> Path:
    """Build for this machine where a build can live: the package folder
    when it is writable (an install), else the cache folder."""
    try:
        return build_into(PACKAGE_DIR, cc)
    except PermissionError:
        return build_into(cache_dir(), cc)
