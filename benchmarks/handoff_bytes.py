"""Prefill and decode on different engines: the bytes a decode engine needs
per prompt, against shipping every layer's KV.

For every config in models/, its planned layout (default block size), and
prompts of 1K / 4K / 32K tokens: the blocks a hit of the prompt's whole
blocks reads (`KVCacheLayout.hit_bytes`: every full-attention block, the
blocks a window or chunk still sees, one state per recurrent group; what
kv_role="prefill" ships, test-checked block for block), against every
layer's cache at every position plus one state per recurrent group
(`all_layers_bytes`), both in the layout's pages.

    python -m benchmarks.handoff_bytes
"""

from __future__ import annotations

import glob
import os

from benchmarks import harness
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.core.layout import plan_layout

MODELS = os.path.join(harness.ROOT, "models")
PROMPTS = (1024, 4096, 32768)


def measure(path: str) -> dict:
    layout = plan_layout(specs_from_config(load_config(path)), "64GiB")
    row = {"model": os.path.basename(path)[:-5], "block_size": layout.block_size,
           "groups": [g.kind for g in layout.groups], "prompts": {}}
    for tokens in PROMPTS:
        hit = (tokens - 1) // layout.block_size * layout.block_size  # what a decode engine's lookup takes
        shipped, everything = layout.hit_bytes(hit), layout.all_layers_bytes(hit)
        row["prompts"][str(tokens)] = {"hit_tokens": hit, "bytes": shipped, "all_layers_bytes": everything,
                                       "fraction": shipped / everything}
    return row


def run(args) -> dict:
    rows = [measure(path) for path in sorted(glob.glob(os.path.join(MODELS, "*.json")))]
    print(f"{'model':<28} {'block':>5} " + " ".join(f"{t:>22,}" for t in PROMPTS))
    for row in rows:
        cells = [f"{p['bytes'] / 2**20:>10,.1f} MiB {p['fraction']:>6.1%}" for p in row["prompts"].values()]
        print(f"{row['model']:<28} {row['block_size']:>5} " + " ".join(f"{c:>22}" for c in cells))
    return {"models": rows}


if __name__ == "__main__":
    harness.main(run)
