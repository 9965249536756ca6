"""Building hybridkv's C libraries for this machine: at install time (setup.py
runs `build_all` where a compiler exists) or by `hybridkv build-kernels`;
never while serving. Standard library only, and no import of the rest of
the package, so that setup.py can run this file alone before anything else
is installed.

Why build on the machine rather than ship binaries: `-march=native` gives
the CPU kernels the machine's own vector width, which the decode figures
depend on. A library is named by a key of its source, flags, architecture
and the CPU's feature flags, so a package folder or cache shared by
machines of different CPUs keeps one build per CPU and never loads one
built for another (which could die on an illegal instruction). A finished
build is renamed into place, so processes starting together never load
half a file.

The libraries (`LIBRARIES`):
* the cpu backend's kernels (layers/backends/cpu/kernels.c);
* the block-key chain (core/hash_chain.c): SHA-256 over a prompt's blocks
  in one call, for core/hashing.py.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parent.parent  # the package


def cache_root() -> str:
    """Where hybridkv keeps what it builds for the user (hybridkv/files.py):
    $HYBRIDKV_CACHE, else ~/.cache/hybridkv."""
    return os.environ.get("HYBRIDKV_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "hybridkv"))


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> str:
    """The CPU's feature flags (Linux: x86's "flags", Arm's "Features"),
    else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


@dataclass(frozen=True)
class NativeLibrary:
    """One C source built into one shared library per machine."""

    source: Path
    flags: tuple[str, ...]
    cache_name: str  # its folder under hybridkv's cache root
    package_dir: Path  # where an install puts its build
    libs: tuple[str, ...] = ()  # linker arguments after the source

    def cache_dir(self) -> Path:
        """Builds made after install: `cache_name/` under hybridkv's cache
        root (~/.cache/hybridkv, or $HYBRIDKV_CACHE)."""
        return Path(cache_root()) / self.cache_name

    def machine_key(self) -> str:
        digest = hashlib.sha256(self.source.read_bytes() + " ".join(self.flags).encode() +
                                platform.machine().encode() + cpu_flags().encode())
        return digest.hexdigest()[:16]

    def library_name(self) -> str:
        return f"{self.source.stem}-{self.machine_key()}.so"

    def built_library(self) -> Path | None:
        """This machine's build of the current source, where one exists."""
        name = self.library_name()
        for folder in (self.package_dir, self.cache_dir()):
            if (folder / name).is_file():
                return folder / name
        return None

    def build_into(self, folder: Path, cc: str | None = None) -> Path:
        """Compile the source into `folder` (made if missing); returns the
        library's path. Raises RuntimeError with the compiler's message, or
        when no compiler is found."""
        cc = cc or compiler()
        if cc is None:
            raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / self.library_name()
        fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run([cc, *self.flags, str(self.source), "-o", partial, *self.libs],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{os.path.basename(cc)} failed: {done.stderr.strip()[-800:]}")
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return target

    def build(self, cc: str | None = None) -> Path:
        """Build for this machine where a build can live: the package folder
        when it is writable (an install), else the cache folder."""
        try:
            return self.build_into(self.package_dir, cc)
        except PermissionError:
            return self.build_into(self.cache_dir(), cc)


def _library(source: str, flags: list[str], cache_name: str, libs: tuple[str, ...] = ()) -> NativeLibrary:
    path = ROOT / source
    return NativeLibrary(path, tuple(flags), cache_name, path.with_name("_built"), libs)


# Reassociating float sums lets the compiler vectorise the dot products;
# no -ffast-math: it would also assume no infinities or NaNs.
CPU_KERNELS = _library("layers/backends/cpu/kernels.c",
                       ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                        "-fno-signed-zeros", "-fassociative-math", "-shared", "-fPIC", "-std=c11"],
                       "cpu-kernels", ("-lm",))
# Portable code (SHA-256 itself is the libcrypto Python's hashlib loaded).
HASH_CHAIN = _library("core/hash_chain.c", ["-O2", "-shared", "-fPIC", "-std=c11"], "hash-chain")
LIBRARIES = (CPU_KERNELS, HASH_CHAIN)


def build_all(package_root: Path | None = None) -> list[tuple[NativeLibrary, Path | Exception]]:
    """Build every library (into `package_root`'s copy of each one's
    package folder, e.g. an install's build tree; by default the source
    tree's). Per library its path, or the error that stopped it: a library
    not built leaves its users on their pure-Python or torch path."""
    out = []
    for library in LIBRARIES:
        folder = library.package_dir if package_root is None else \
            Path(package_root) / library.package_dir.relative_to(ROOT)
        try:
            out.append((library, library.build_into(folder)))
        except (RuntimeError, OSError) as error:
            out.append((library, error))
    return out
