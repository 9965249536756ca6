"""The one thing pyproject.toml cannot say: build hybridkv's C libraries for
this machine while installing (hybridkv/core/native.py: the cpu backend's
kernels and the block-key chain). Where no compiler is found or a build
fails, the install goes on and says so; `hybridkv build-kernels` builds
them later."""

import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybridkv", "core", "native.py")


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        native = runpy.run_path(NATIVE)
        # An editable install imports the source tree; a regular one the build folder.
        root = None if getattr(self, "editable_mode", False) else os.path.join(self.build_lib, "hybridkv")
        for library, built in native["build_all"](root):
            if isinstance(built, Exception):
                print(f"hybridkv: {library.source.name} was not built ({built}): run `hybridkv build-kernels` "
                      f"where a C compiler exists", file=sys.stderr)
            else:
                print(f"hybridkv: built {library.source.name} for this machine: {built}")


setup(cmdclass={"build_py": BuildWithKernels})
