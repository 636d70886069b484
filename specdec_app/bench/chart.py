"""The benchmark's PNG chart (matplotlib): speedup over plain decoding per category and method."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from specdec_app.bench.report import BASELINE, OVERALL, arrival_patterns, cell_summaries


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
    ax.set_title(
        f"specdec bench: {report['config']['target']}, {machine['device']}, "
        f"{report['config']['max_new_tokens']} new tokens, greedy",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncols=2)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _line(ax, cells: list[dict], key: str, style: str, color: str, label: str, with_range: bool = False) -> None:
    """One method's ``stats[key]`` against N (:func:`cell_summaries`: the medians over repeats),
    its cells without a value left out; ``with_range``: each point's range over the repeats as an
    error bar (where it has two repeats or more)."""
    cells = [c for c in cells if c["stats"][key] is not None]
    if not cells:
        return
    ranges = [c["spreads"].get(key) for c in cells] if with_range else []
    errors = None
    if any(found and found["num_repeats"] > 1 for found in ranges):
        errors = [
            [c["stats"][key] - found["min"] if found else 0.0 for c, found in zip(cells, ranges, strict=True)],
            [found["max"] - c["stats"][key] if found else 0.0 for c, found in zip(cells, ranges, strict=True)],
        ]
    x, y = [c["concurrency"] for c in cells], [c["stats"][key] for c in cells]
    ax.errorbar(x, y, yerr=errors, fmt=style, color=color, marker="o", markersize=3, capsize=2, label=label)


def write_concurrency_chart(report: dict, path: Path) -> None:
    """``specdec bench concurrency``: a row per arrival pattern of three panels against N (log scale), one line
    per method: total output tokens/s (with repeats, the medians and their range), TPOT p50
    (solid) and p99 (dashed), TTFT p50 (solid) and p99 (dashed)."""
    patterns = arrival_patterns(report)
    summaries = cell_summaries(report)
    repeats = max((c["num_repeats"] for c in summaries), default=1)
    throughput = "total output tokens/s" + (f" (median of {repeats} runs, bars min-max)" * (repeats > 1))
    fig, rows = plt.subplots(len(patterns), 3, figsize=(13.0, 4.0 * len(patterns)), layout="constrained", squeeze=False)
    ticks = sorted({c["concurrency"] for c in report["cells"]})
    for arrivals, axes in zip(patterns, rows, strict=True):
        for i, method in enumerate(report["methods"]):
            cells = sorted(
                (c for c in summaries if c["method"] == method and c["arrivals"] == arrivals),
                key=lambda c: c["concurrency"],
            )
            color = f"C{i}"
            _line(axes[0], cells, "tokens_per_second", "-", color, method, with_range=True)
            _line(axes[1], cells, "tpot_ms_p50", "-", color, f"{method} p50")
            _line(axes[1], cells, "tpot_ms_p99", "--", color, f"{method} p99")
            _line(axes[2], cells, "ttft_ms_p50", "-", color, f"{method} p50")
            _line(axes[2], cells, "ttft_ms_p99", "--", color, f"{method} p99")
        for ax, label in zip(
            axes,
            [throughput, "TPOT ms (time per output token)", "TTFT ms (time to first token)"],
            strict=True,
        ):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_xlabel("concurrent clients N")
            ax.set_ylabel(label)
            ax.set_title(f"arrivals: {arrivals}", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    machine, config = report["machine"], report["config"]
    fig.suptitle(
        f"specdec bench concurrency: {config['target']}, {machine['device']} ({machine['cpu_count']} cores), "
        f"{config['max_new_tokens']} new tokens, greedy",
        fontsize=9,
    )
    fig.savefig(path, dpi=150)
    plt.close(fig)
