"""Plots ``bench_scheduler.py``'s JSON output: coalescing modes and loop lag.

Usage:
    python bench/plot_scheduler.py [SCHEDULER_JSON] [OUT_DIR]

Defaults: ``bench/out/scheduler.json`` to ``bench/out/``. Writes ``coalesce.png`` (ms per
64 all-reduces per mode, median with a bar to p90) and ``scheduler_lag.png`` (lag of a
1 ms ticker, p50/p99/max, against the number of all-reduces in flight), both rank 0.
Without matplotlib it says so in one line and writes nothing (exit status 1 from the
command line, whose only job is plotting; ``bench_scheduler.py`` goes on).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _common import OUT_DIR, format_bytes, write_plots

COLORS = ("tab:blue", "tab:green", "tab:red", "tab:orange")


def plot_coalesce(plt: Any, path: Path, coalesce: dict[str, Any]) -> None:
    """ms per 64 all-reduces per mode (``plt``: matplotlib's pyplot)."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    names = list(coalesce)
    medians = [coalesce[n]["median"] * 1e3 for n in names]
    above = [(coalesce[n]["p90"] - coalesce[n]["median"]) * 1e3 for n in names]
    colors = ["grey" if "agang" not in n else "tab:blue" for n in names]
    bars = axes.bar(names, medians, yerr=[[0.0] * len(names), above], capsize=4, color=colors)
    axes.bar_label(bars, [f"{m:.2f}" for m in medians], label_type="center", color="white")
    axes.set(
        yscale="log",
        ylabel="ms per 64 all_reduces: median, bar to p90",
        title="64 all_reduces of 4 KiB, 2 Gloo ranks on loopback (rank 0)",
    )
    axes.tick_params(axis="x", labelsize=8)
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_lag(plt: Any, path: Path, document: dict[str, Any]) -> None:
    """The ticker's lag against ops in flight (``plt``: matplotlib's pyplot)."""
    lag, counts = document["ranks"][0]["lag"], document["lag_counts"]
    sizes, modes = document["plan"]["lag_sizes"], document["lag_modes"]
    figure, panels = plt.subplots(
        1, len(sizes), figsize=(6.5 * len(sizes), 6), squeeze=False, layout="constrained"
    )
    styles = {"median": ":", "p99": "-", "max": "--"}
    for axes, size in zip(panels[0], sizes, strict=True):
        for mode, color in zip(modes, COLORS, strict=False):
            rows = [lag[f"{size}/{count}/{mode}"]["lag"] for count in counts]
            for stat, style in styles.items():
                axes.plot(
                    counts,
                    [max(row[stat] * 1e3, 1e-3) for row in rows],  # log axis: no zeros
                    style,
                    marker="o",
                    color=color,
                    label=f"{mode} {'p50' if stat == 'median' else stat}",
                )
        axes.axhline(lag["idle"]["lag"]["p99"] * 1e3, color="grey", linewidth=1, label="idle p99")
        axes.axhline(
            document["lag_target_s"] * 1e3,
            color="black",
            linestyle="-.",
            linewidth=1,
            label="target: agang p99 at 1000",
        )
        axes.set(
            xscale="log",
            yscale="log",
            xlabel="all_reduces in flight",
            ylabel="ms late: p50 dotted, p99 solid, max dashed",
            title=f"{format_bytes(size)} each: lag of a 1 ms ticker (rank 0)",
        )
        axes.set_xticks(counts, [str(count) for count in counts])
        axes.minorticks_off()
        axes.grid(True, alpha=0.3)
    handles, labels = panels[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=2 + len(sizes), fontsize=8)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot(source: Path, out_dir: Path) -> list[Path]:
    """Writes both plots from ``source``; returns their paths, none without matplotlib."""
    if not isinstance(source, Path) or not isinstance(out_dir, Path):
        raise TypeError(f"`source` and `out_dir` must be Paths, not {source!r}, {out_dir!r}.")
    document = json.loads(source.read_text())
    paths = [out_dir / "coalesce.png", out_dir / "scheduler_lag.png"]

    def draw(plt: Any) -> None:
        plot_coalesce(plt, paths[0], document["ranks"][0]["coalesce"])
        plot_lag(plt, paths[1], document)

    return write_plots(paths, draw)


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else OUT_DIR / "scheduler.json"
    out_dir = Path(argv[1]) if len(argv) > 1 else OUT_DIR
    if not source.exists():
        print(f"{source} not found: run `python bench/bench_scheduler.py` first.")
        return 1
    written = plot(source, out_dir)
    if not written:
        return 1
    print("Wrote " + ", ".join(str(path) for path in written) + ".")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
