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
