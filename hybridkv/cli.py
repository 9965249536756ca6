"""The `hybridkv` command: plan | demo | serve."""

from __future__ import annotations

import argparse
import sys

CONTEXTS = (1024, 8192, 32768, 131072)


def _plan(args) -> int:
    from .core.hf_config import load_config, specs_from_config
    from .core.layout import parse_memory, plan_layout

    config = load_config(args.config)
    specs = specs_from_config(config, dtype=args.dtype)
    layout = plan_layout(specs, parse_memory(args.memory), block_size=args.block_size)
    print(f"{args.config}: {len(specs)} layers with a cache, {len(layout.groups)} group(s)")
    print(layout.describe())
    waste = layout.static_waste_bytes
    print(f"static waste: {waste:,} B ({100 * waste / layout.memory_bytes:.4f}% of the budget: "
          f"the null page and the remainder under one page)")
    print(f"\n{'context':>8} {'pages/request':>14} {'requests that fit':>18}")
    for context in CONTEXTS:
        print(f"{context:>8} {layout.pages_per_request(context):>14,} {layout.max_requests(context):>18,}")
    if args.plot:
        from .plot import plot_layout

        plot_layout(layout, args.config, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


def _demo(args) -> int:
    from .demo import main as demo_main

    demo_main(num_requests=args.requests, max_tokens=args.max_tokens, progress=not args.no_progress)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="plan the KV cache layout of a model config")
    plan.add_argument("config", help="a config.json file (see models/) or a model folder")
    plan.add_argument("--memory", default="80GiB", help="KV cache budget, e.g. 80GiB (default)")
    plan.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    plan.add_argument("--dtype", default=None, help="KV dtype (default: the config's)")
    plan.add_argument("--plot", default=None, metavar="PNG", help="also draw the layout (needs matplotlib)")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser("demo", help="serve a batch on tiny built-in Gemma-3 and Jamba models")
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--no-progress", action="store_true")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"hybridkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
