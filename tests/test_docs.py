"""The code blocks of docs/api.md run as written (in order, one namespace)."""

import os
import re

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


def test_api_examples_run(monkeypatch):
    monkeypatch.chdir(os.path.join(DOCS, ".."))
    with open(os.path.join(DOCS, "api.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/api.md", "exec"), namespace)


def test_the_docs_name_every_architecture_the_engine_runs():
    from hybridkv.core.hf_config import ENGINE_ARCHITECTURES

    for page in ("api.md", "engine.md"):
        with open(os.path.join(DOCS, page)) as f:
            text = f.read()
        assert [a for a in ENGINE_ARCHITECTURES if a not in text] == [], page


def test_observability_example_prints_what_the_doc_shows():
    import subprocess
    import sys

    root = os.path.join(DOCS, "..")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    out = subprocess.run([sys.executable, "docs/examples/jamba_explain.py"], cwd=root, env=env,
                         capture_output=True, text=True, check=True).stdout
    with open(os.path.join(DOCS, "observability.md")) as f:
        shown = re.findall(r"```\n(request .*?)```", f.read(), re.S)
    assert len(shown) == 2
    for block in shown:
        assert block in out
