"""Memory: waste and capacity of the planned layout against other designs.

For every config in models/, at max contexts 1K / 8K / 32K / 128K and a fixed
KV budget: the bytes the layout wastes, and how many requests fit with
hybridkv, with (a) a contiguous per-request cache sized for the max context,
(b) padded equal-size layer groups (vLLM's documented rule), (c) the exact
per-layer need. A second table does the same for a realistic length mix
(lengths drawn log-uniformly up to the max context): paged designs hold each
request's own length, a contiguous cache reserves the max for every request
(its sliding layers capped at their window, as transformers' caches are; the
JSON also has the uncapped figure, every layer sized for the max context).

    python -m benchmarks.memory [--quick] [--budget 60GiB]
"""

from __future__ import annotations

import glob
import os

from benchmarks import harness
from hybridkv.core.baselines import (PaddedGroups, contiguous_bytes, exact_bytes, hybridkv_bytes, length_mix,
                                     mean_bytes)
from hybridkv.core.hf_config import load_config, specs_from_config
from hybridkv.core.layout import parse_memory, plan_layout

MODELS = os.path.join(harness.ROOT, "models")
CONTEXTS = (1024, 8192, 32768, 131072)


def measure(path: str, budget: int, contexts) -> dict:
    specs = specs_from_config(load_config(path))
    layout = plan_layout(specs, budget)
    padded = PaddedGroups(specs)
    usable = layout.pool_bytes - layout.page_size_bytes  # the null page excluded
    row = {"model": os.path.basename(path)[:-5], "groups": len(layout.groups),
           "waste_fraction": layout.static_waste_bytes / budget,
           "padded_groups": sum(n for _, n in padded.groups), "padding_layers": padded.padding_layers,
           "padded_waste_fraction": padded.waste_fraction(), "fixed": {}, "mix": {}}
    for context in contexts:
        row["fixed"][context] = {
            "hybridkv": usable // hybridkv_bytes(layout, context),
            "contiguous": budget // contiguous_bytes(specs, context),
            "padded": budget // padded.bytes_per_request(context),
            "exact": budget // exact_bytes(specs, context),
        }
        lengths = length_mix(context)
        mean = {
            "hybridkv": mean_bytes(lambda t: hybridkv_bytes(layout, t), lengths),
            "padded": mean_bytes(padded.bytes_per_request, lengths),
            "exact": mean_bytes(lambda t: exact_bytes(specs, t), lengths),
        }
        row["mix"][context] = {name: int(budget // value) for name, value in mean.items()}
        row["mix"][context]["hybridkv"] = int(usable // mean["hybridkv"])
        row["mix"][context]["contiguous"] = budget // contiguous_bytes(specs, context)
        row["mix"][context]["contiguous_uncapped"] = budget // contiguous_bytes(specs, context, cap_windows=False)
    return row


def arguments(parser) -> None:
    parser.add_argument("--budget", default="60GiB", help="KV budget (--quick: two models, two contexts)")


def run(args) -> dict:
    budget = parse_memory(args.budget)
    paths = sorted(glob.glob(os.path.join(MODELS, "*.json")))
    contexts = CONTEXTS
    if args.quick:
        paths = [p for p in paths if os.path.basename(p) in ("gemma-3-27b.json", "jamba-1.5-mini.json")]
        contexts = CONTEXTS[:2]
    rows = [measure(p, budget, contexts) for p in paths]

    print(f"KV budget {args.budget}. Waste: bytes no layer can use.")
    print(f"{'model':<20} {'groups':>6} {'waste':>9} | {'padded groups':>13} {'pad layers':>10} {'padded waste':>12}")
    for r in rows:
        print(f"{r['model']:<20} {r['groups']:>6} {100 * r['waste_fraction']:>8.4f}% | {r['padded_groups']:>13} "
              f"{r['padding_layers']:>10} {100 * r['padded_waste_fraction']:>11.2f}%")
    for table, title in (("fixed", "every request at the max context"),
                         ("mix", "log-uniform length mix up to the max context")):
        print(f"\nRequests that fit, {title} (hybridkv / contiguous / padded groups / exact need)")
        print(f"{'model':<20} " + " ".join(f"{c:>26}" for c in contexts))
        for r in rows:
            cells = []
            for c in contexts:
                v = r[table][c]
                cells.append(f"{v['hybridkv']:>6}/{v['contiguous']:>6}/{v['padded']:>6}/{v['exact']:>6}")
            print(f"{r['model']:<20} " + " ".join(f"{cell:>26}" for cell in cells))
    gemma = next((r for r in rows if r["model"] == "gemma-3-27b"), None)
    if gemma and 8192 in gemma["mix"]:
        mix = gemma["mix"][8192]
        print(f"\nGemma-3-27B, 8K length mix: hybridkv holds {mix['hybridkv'] / max(1, mix['contiguous']):.1f}x "
              f"the requests of a contiguous cache with window-capped sliding layers "
              f"({mix['hybridkv'] / max(1, mix['contiguous_uncapped']):.1f}x one sized for the max context in "
              f"every layer), {mix['hybridkv'] / max(1, mix['padded']):.2f}x padded groups, "
              f"{mix['hybridkv'] / max(1, mix['exact']):.3f}x the exact need")
    return {"models": rows}


if __name__ == "__main__":
    harness.main(run, arguments)
