"""Ratio plots for the benchmarks (optional: needs matplotlib, the ``bench`` extra; nothing else imports it).

``save_ratio_plot`` draws, per panel, one line per series of ``(x, median, low, high)`` points (median with a
spread band), a dashed line at each target ratio, and writes a PNG. Without matplotlib it returns None and the
benchmark only prints its table.
"""

from __future__ import annotations

import math
import pathlib


def save_ratio_plot(path, panels: dict, xlabel: str, ylabel: str, targets: dict | None = None, log_x: bool = True):
    """Write a PNG with one subplot per ``panels`` entry; returns the path, or None without matplotlib.

    Args:
        path: output file (``.png``); parent folders are created.
        panels: ``{panel title: {series label: [(x, median, low, high), ...]}}``.
        xlabel, ylabel: axis labels (e.g. "context (tokens)", "kvops / ideal").
        targets: ``{panel title: ratio}`` drawn as a dashed horizontal line (e.g. a 1.2x target).
        log_x: log2 x axis (context lengths, chunk counts).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(panels)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for label, points in series.items():
            points = sorted(points)
            xs = [p[0] for p in points]
            ax.plot(xs, [p[1] for p in points], marker="o", label=label)
            ax.fill_between(xs, [p[2] for p in points], [p[3] for p in points], alpha=0.2)
        if targets and title in targets:
            ax.axhline(targets[title], linestyle="--", color="gray", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.5)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    sys.exit(
        "benchmarks/plots.py is not a benchmark: it is the plotting helper the benchmarks import to save their ratio "
        "plots (needs matplotlib: pip install -e '.[bench]').\nRun a benchmark instead, e.g. "
        "python benchmarks/paged_decode.py --quick (python benchmarks/<name>.py --help lists its options)."
    )
