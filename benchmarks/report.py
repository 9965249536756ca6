"""What every benchmark script does with its results: the JSON file under
benchmarks/results/ (or --out), and a line saying where it went."""

from __future__ import annotations

import json
import os


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")
