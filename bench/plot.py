"""Bandwidth against slice size, one line per transport and baseline (matplotlib, the ``plots`` extra).

One panel per (layout, blocks moved); ceilings dashed. Without matplotlib ``plot`` returns a note.
"""

from __future__ import annotations

from pathlib import Path

from .presets import fmt_bytes

__all__ = ["plot"]


def _series(doc: dict) -> dict[tuple, dict[str, list[tuple[int, float, str]]]]:
    """(layout, blocks) -> series name -> [(slice bytes, GB/s, kind)]"""
    panels: dict[tuple, dict[str, list]] = {}
    for rec in doc["workloads"]:
        w = rec["workload"]
        panel = panels.setdefault((w["layout"], w["blocks_moved"], w["num_layers"], w["num_kv"]), {})
        for r in [x["result"] for x in rec["runs"] if x["result"]] + rec["baselines"]:
            panel.setdefault(r["name"], []).append((w["slice_bytes"], r["gb_per_s"], r["kind"]))
    return panels


def plot(doc: dict, folder: Path) -> tuple[list[Path], str | None]:
    """Write ``bandwidth_vs_slice.png`` into ``folder``; returns (paths, note when skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install 'xfer[plots]')"
    panels = {k: v for k, v in _series(doc).items() if v}
    if not panels:
        return [], "plots skipped: no measurement to plot"
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), squeeze=False, dpi=80)
    for ax, ((layout, blocks, layers, kv), series) in zip(axes.flat, sorted(panels.items())):
        for name, pts in series.items():
            pts.sort()
            xs, ys, kinds = zip(*pts)
            style = "--" if kinds[0] == "ceiling" else ("-" if kinds[0] == "xfer" else ":")
            width = 2.2 if kinds[0] == "xfer" else 1.3
            ax.plot(xs, ys, style, marker="o", lw=width, ms=4, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({x for pts in series.values() for x, _, _ in pts})
        ax.set_xticks(ticks, [fmt_bytes(x) for x in ticks], rotation=30 if len(ticks) > 5 else 0)
        ax.minorticks_off()
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("slice size (one block of one layer's K or V)")
        ax.set_ylabel("GB/s (median)")
        what = "K/V" if kv == 2 else "latent"
        ax.set_title(f"{layout}: {layers} layers x {what} x {blocks} blocks = {layers * kv * blocks:,} slices",
                     fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    i = doc["initiator"]
    fig.suptitle(f"xfer-bench {doc['date'][:10]}  {doc['mode']}  {i['device']} ({i['device_name']})", fontsize=10)
    fig.tight_layout()
    path = folder / "bandwidth_vs_slice.png"
    fig.savefig(path)
    plt.close(fig)
    return [path], None
