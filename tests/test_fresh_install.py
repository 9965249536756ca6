"""The README's two commands on a fresh machine: its install line brings
everything the test suite imports, or a test skips naming the extra it
needs. (`.ci/fresh_machine` runs the two commands for real in a new virtual
environment; these checks catch the same mistakes in seconds.)"""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
readme_commands = runpy.run_path(os.path.join(ROOT, ".ci", "readme_commands.py"))["readme_commands"]


def readme_extras() -> list[str]:
    install = readme_commands()[0]
    found = re.search(r'pip install -e "\.\[([a-z,]+)\]"', install)
    assert found, install
    return found.group(1).split(",")


def test_the_readme_opens_with_install_and_demo_then_the_tests():
    install, tests = readme_commands()
    assert install.startswith("pip install -e ") and install.endswith("&& hybridkv demo")
    assert tests == "python -m pytest -q"
    assert "test" in readme_extras()


def test_every_test_module_imports_with_only_what_the_readme_installs():
    # Packages outside hybridkv[<the README's extras>] and their requirements
    # are made unimportable; each test module must then import, or skip with
    # a reason that names the extra to install.
    script = textwrap.dedent(r"""
        import importlib, importlib.abc, importlib.metadata as md, os, sys
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        extras = set(sys.argv[1].split(","))
        wanted, todo = set(), [("hybridkv", frozenset(extras))]
        while todo:
            name, ex = todo.pop()
            if (canonicalize_name(name), ex) in wanted:
                continue
            wanted.add((canonicalize_name(name), ex))
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            for line in dist.requires or []:
                req = Requirement(line)
                if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ex | {""}):
                    todo.append((req.name, frozenset(req.extras)))
        allowed = {n for n, _ in wanted}
        blocked = {top for top, dists in md.packages_distributions().items()
                   if top not in sys.stdlib_module_names
                   and not any(canonicalize_name(d) in allowed for d in dists)}

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in blocked:
                    raise ModuleNotFoundError(f"No module named {name!r} (not in hybridkv[{sys.argv[1]}])", name=name)
                return None

        sys.meta_path.insert(0, Absent())
        import _pytest.outcomes
        sys.path.insert(0, "tests")
        failed = []
        for file in sorted(os.listdir("tests")):
            if not (file.startswith("test_") and file.endswith(".py")):
                continue
            try:
                importlib.import_module(file[:-3])
            except _pytest.outcomes.Skipped as skip:
                if "extra" not in str(skip):
                    failed.append(f"{file}: skips without naming an extra: {skip}")
            except Exception as error:
                failed.append(f"{file}: {type(error).__name__}: {error}")
        print("\n".join(failed))
        sys.exit(1 if failed else 0)
    """)
    done = subprocess.run([sys.executable, "-c", script, ",".join(readme_extras())], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_optional_imports_in_tests_name_their_extra():
    # `pytest.importorskip("x")` alone says "could not import 'x'"; a reader
    # needs the extra that brings it.
    bare = []
    for file in sorted(os.listdir(os.path.join(ROOT, "tests"))):
        if file.endswith(".py"):
            with open(os.path.join(ROOT, "tests", file)) as f:
                for n, line in enumerate(f, 1):
                    call = re.search(r"^[^#]*importorskip\((.*)\)", line)
                    if call and "extra" not in call.group(1):
                        bare.append(f"{file}:{n}: {line.strip()}")
    assert bare == []
