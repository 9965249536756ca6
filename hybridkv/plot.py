"""`hybridkv plan --plot`: a picture of a layout and of its capacity."""

from __future__ import annotations

from .core.baselines import PaddedGroups, contiguous_bytes, exact_bytes, hybridkv_bytes, length_mix, mean_bytes
from .core.layout import KVCacheLayout


def plot_layout(layout: KVCacheLayout, title: str, path: str) -> None:
    """Left: one block of every group, page by page, each page split into the
    layers it holds (hatched: bytes no layer uses). Right: requests that fit
    the budget against context length, with the baselines of
    core/baselines.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    specs = {name: layout.groups[view.group].spec for name, view in layout.layer_views.items()}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.3, 1]})
    page = layout.page_size_bytes
    colors = plt.cm.tab10.colors
    widest = max(g.pages_per_block for g in layout.groups)
    for row, group in enumerate(layout.groups):
        y = len(layout.groups) - 1 - row
        color = colors[row % len(colors)]
        used = group.block_bytes
        for p in range(group.pages_per_block):
            start, end = p * page, (p + 1) * page
            filled = max(0, min(end, used) - start) / page
            left.add_patch(Rectangle((p, y + 0.1), filled, 0.8, facecolor=color, edgecolor="white", linewidth=0.5))
            if filled < 1:
                left.add_patch(Rectangle((p + filled, y + 0.1), 1 - filled, 0.8, facecolor="none",
                                         edgecolor="grey", hatch="///", linewidth=0.5))
        if not group.recurrent:  # mark the layer boundaries inside the pages
            for name in group.layer_names[1:]:
                column, offset, _ = layout.layer_views[name].places[0]
                x = column + offset / page
                left.plot([x, x], [y + 0.1, y + 0.9], color="white", linewidth=0.4)
        label = f"{group.kind} x{group.num_layers}: {group.pages_per_block} page(s)"
        left.text(-0.5, y + 0.5, label, ha="right", va="center", fontsize=8)
    left.set_xlim(-0.2, widest + 0.2)
    left.set_ylim(0, len(layout.groups))
    left.set_yticks([])
    left.set_xlabel(f"pages of {page / 1024:.0f} KiB (one block of each group; {layout.block_size} tokens per "
                    f"attention block)")
    left.set_title(f"{title}: layout, {layout.num_pages:,} pages, waste "
                   f"{100 * layout.static_waste_bytes / layout.memory_bytes:.4f}%", fontsize=9)

    contexts = [2 ** k for k in range(10, 18)]
    padded = PaddedGroups(specs, layout.block_size)
    budget = layout.memory_bytes
    usable = layout.pool_bytes - page
    mixes = {c: length_mix(c, n=400) for c in contexts}
    series = {
        "hybridkv": [usable / mean_bytes(lambda t: hybridkv_bytes(layout, t), mixes[c]) for c in contexts],
        "exact need": [budget / mean_bytes(lambda t: exact_bytes(specs, t), mixes[c]) for c in contexts],
        f"padded groups ({padded.padding_layers} padding layers)": [
            budget / mean_bytes(padded.bytes_per_request, mixes[c]) for c in contexts],
        "contiguous, sliding layers capped": [budget // contiguous_bytes(specs, c) for c in contexts],
        "contiguous, every layer": [budget // contiguous_bytes(specs, c, cap_windows=False) for c in contexts],
    }
    for (name, values), style in zip(series.items(), ["-o", ":", "--", "-.", "-."]):
        right.plot(contexts, [max(v, 0.5) for v in values], style, label=name, markersize=3)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("max context (lengths log-uniform up to it; contiguous reserves the max)", fontsize=8)
    right.set_ylabel(f"requests that fit in {budget / 2**30:.0f} GiB")
    right.legend(fontsize=7)
    right.grid(True, which="both", alpha=0.3)
    right.set_title("capacity vs context", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
