"""plot.png: per workload, tokens/s by draft length (x) and batch size (colour), each drafter a line style,
adaptive a large marker at the right, transformers a dashed line, whiskers the min–max over the repeats; a last
row of panels, one per batch size, with each system's fraction of the bandwidth floor over the workloads."""
from __future__ import annotations

import math
from pathlib import Path

from jobs.bench.config import BenchConfig
from jobs.bench.systems import TRANSFORMERS, adaptive_name, bench_systems, fixed_name

_STYLES = ["-", "--", "-.", ":"]
_MARKERS = ["*", "P", "X", "D"]


def _workload_panel(ax, rows: list[dict], cfg: BenchConfig, colors: list[str]) -> None:
    cells = {(r["batch_size"], r["system"]): r for r in rows}
    ks = sorted(set(cfg.ks))
    for i, b in enumerate(cfg.batch_sizes):
        color = colors[i % len(colors)]
        for j, drafter in enumerate(cfg.drafters):
            fixed = [(x, cells[(b, fixed_name(drafter, k))]) for x, k in enumerate(ks) if (b, fixed_name(drafter, k)) in cells]
            adaptive = cells.get((b, adaptive_name(drafter)))
            for points, fmt, label in ((fixed, "o" + _STYLES[j % len(_STYLES)], f"{drafter} b={b}"),
                                       ([(len(ks), adaptive)] if adaptive else [], _MARKERS[j % len(_MARKERS)], None)):
                if points:
                    xs, rows_ = zip(*points)
                    ys = [c["tokens_per_s"] for c in rows_]
                    whiskers = [[y - c["tokens_per_s_min"] for y, c in zip(ys, rows_)],
                                [c["tokens_per_s_max"] - y for y, c in zip(ys, rows_)]]
                    ax.errorbar(xs, ys, yerr=whiskers, fmt=fmt, color=color, capsize=2, label=label,
                                markersize=14 if label is None else 4, markeredgecolor="black" if label is None else color)
        if (b, TRANSFORMERS) in cells:
            ax.axhline(cells[(b, TRANSFORMERS)]["tokens_per_s"], color=color, linestyle="--", linewidth=1,
                       label=f"transformers b={b}")
    others = sorted((s, r["tokens_per_s"]) for (b, s), r in cells.items() if s.startswith("transformers ") and b == 1)
    for j, (name, rate) in enumerate(others):
        ax.axhline(rate, color="gray", linestyle=[":", "-.", (0, (1, 3))][j % 3], linewidth=1.2, label=f"{name} b=1")
    ax.set_xticks(range(len(ks) + 1), [str(k) for k in ks] + ["adaptive"])
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def _floor_panel(ax, rows: list[dict], cfg: BenchConfig, batch_size: int) -> None:
    names = [s.name for s in bench_systems(cfg, batch_size)]
    for x, name in enumerate(names):
        fractions = [100 * r["floor_fraction"] for r in rows if r["system"] == name and r["floor_fraction"] is not None]
        if fractions:
            ax.scatter([x] * len(fractions), fractions, s=12, alpha=0.5, color="tab:blue")
            ax.scatter([x], [sorted(fractions)[len(fractions) // 2]], marker="_", s=300, color="black")
    ax.set_xticks(range(len(names)), [n.removeprefix("specbatch ") for n in names], rotation=60, ha="right", fontsize=7)
    ax.set_title(f"b={batch_size}: % of the bandwidth floor", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)


def plot(results: list[dict], cfg: BenchConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = [r for r in results if r["section"] == "generation"]
    workloads = list(dict.fromkeys(r["workload"] for r in gen))
    cols = max(1, min(4, len(workloads)), min(4, len(cfg.batch_sizes)))
    grid_rows = math.ceil(len(workloads) / cols)
    floor_rows = math.ceil(len(cfg.batch_sizes) / cols)
    fig = plt.figure(figsize=(4.2 * cols, 3.4 * grid_rows + 4.0 * floor_rows))
    spec = fig.add_gridspec(grid_rows + floor_rows, cols, height_ratios=[3.4] * grid_rows + [4.0] * floor_rows)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    first = None
    for i, workload in enumerate(workloads):
        ax = fig.add_subplot(spec[i // cols, i % cols])
        _workload_panel(ax, [r for r in gen if r["workload"] == workload], cfg, colors)
        ax.set_title(workload, fontsize=10)
        if i % cols == 0:
            ax.set_ylabel("generated tokens/s")
        first = first or ax
    for i, b in enumerate(cfg.batch_sizes):
        _floor_panel(fig.add_subplot(spec[grid_rows + i // cols, i % cols]), [r for r in gen if r["batch_size"] == b], cfg, b)
    if first is not None:
        handles, labels = first.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.12 / (grid_rows + floor_rows)))
    fig.savefig(path, dpi=110)
    plt.close(fig)
