"""The benchmark's PNG chart (matplotlib): speedup over plain decoding per category and method."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402

from specdec.bench.report import BASELINE, OVERALL  # noqa: E402


def write_chart(report: dict, path: Path) -> None:
    """Grouped bars: one group per category (and overall), one bar per method other than plain,
    with a line at 1x (plain decoding)."""
    groups = [*report["categories"], OVERALL]
    methods = [m for m in report["methods"] if m != BASELINE]
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups)), 4.0), layout="constrained")
    for i, method in enumerate(methods):
        speedups = [report["summary"][g][method]["speedup"] or 0.0 for g in groups]
        positions = [g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(positions, speedups, width, label=method)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    machine = report["machine"]
    ax.set_title(f"specdec bench: {report['config']['target']}, {machine['device']}, "
                 f"{report['config']['max_new_tokens']} new tokens, greedy", fontsize=9)
    ax.legend(fontsize=7, ncols=2)
    fig.savefig(path, dpi=150)
    plt.close(fig)
