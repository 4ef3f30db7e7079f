"""Plots latency against message size from ``bench_latency.py``'s JSON output.

Usage:
    python bench/plot_latency.py [LATENCY_JSON] [PNG]

Defaults: ``bench/out/latency.json`` to ``bench/out/latency_vs_size.png``. Plots rank 0's
median (with a bar up to p90) for raw blocking c10d, the raw callback-to-asyncio floor
and agang on asyncio, uvloop and trio, on log-log axes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _common import format_bytes

OUT_DIR = Path(__file__).resolve().parent / "out"
MODES = ("c10d blocking", "c10d cb->asyncio", "agang asyncio", "agang uvloop", "agang trio")
STYLES = ("k-", "k:", "-", "-", "-")


def plot(source: Path, target: Path) -> bool:
    """Writes the plot; returns False (writing nothing) if ``source`` does not exist."""
    if not source.exists():
        return False
    document = json.loads(source.read_text())
    rows = [row for row in document["stats"] if row["rank"] == 0]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    for index, (mode, style) in enumerate(zip(MODES, STYLES, strict=True)):
        mine = sorted((row for row in rows if row["mode"] == mode), key=lambda r: r["num_bytes"])
        if not mine:
            continue
        # Nudge each mode sideways a little so the p90 bars do not hide each other.
        sizes = [row["num_bytes"] * 1.06**index for row in mine]
        medians = [row["median"] * 1e3 for row in mine]
        above = [(row["p90"] - row["median"]) * 1e3 for row in mine]
        axes.errorbar(
            sizes,
            medians,
            yerr=[[0.0] * len(mine), above],
            fmt=style,
            marker="o",
            capsize=3,
            label=mode,
        )
    measured = sorted({row["num_bytes"] for row in rows})
    run = "quick run" if document.get("quick") else "full run"
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="message size",
        ylabel="latency of one all_reduce (ms): median, bar to p90",
        title=f"all_reduce, 2 Gloo ranks on loopback, rank 0 (bench_latency.py, {run})",
    )
    axes.set_xticks(measured, [format_bytes(size) for size in measured])
    axes.minorticks_off()
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    plt.close(figure)
    return True


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else OUT_DIR / "latency.json"
    target = Path(argv[1]) if len(argv) > 1 else OUT_DIR / "latency_vs_size.png"
    if not plot(source, target):
        print(f"{source} not found: run `python bench/bench_latency.py` first.")
        return 1
    print(f"Wrote {target}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
