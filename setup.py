"""The one thing pyproject.toml cannot say: build the cpu backend's C
kernels for this machine while installing (hybridkv/layers/backends/cpu/
build.py). Where no compiler is found or the build fails, the install goes
on and says so; `hybridkv build-kernels` builds them later."""

import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hybridkv", "layers", "backends", "cpu", "build.py")


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        build = runpy.run_path(BUILD)
        # An editable install imports the source tree; a regular one the build folder.
        folder = build["PACKAGE_DIR"] if getattr(self, "editable_mode", False) else \
            os.path.join(self.build_lib, "hybridkv", "layers", "backends", "cpu", "_built")
        try:
            path = build["build_into"](folder)
            print(f"hybridkv: built the CPU kernels for this machine: {path}")
        except (RuntimeError, OSError) as error:
            print(f"hybridkv: the CPU kernels were not built ({error}); the cpu backend needs them: "
                  f"run `hybridkv build-kernels` where a C compiler exists", file=sys.stderr)


setup(cmdclass={"build_py": BuildWithKernels})
