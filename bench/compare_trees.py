"""Two trees of agang, one bench, one run: is this change slower than its base?

A change's cost is measured against the commit it started from, on the same machine, in
the same run, taking turns (the order swapped at each round), so that drift and
background load hit both alike; only ratios are compared. The base is checked out in a
git worktree of its own (removed at the end); each tree runs its own copy of the bench
with its own agang on ``PYTHONPATH``.

    python bench/compare_trees.py f239306 weights --quick        # bench_weights.py --quick
    python bench/compare_trees.py f239306 recovery --reps 3      # bench_recovery.py --reps 3
    python bench/compare_trees.py f239306 --runs 4 weights --quick --servers 1 2
    python bench/compare_trees.py 385751d weights --sharded 16777216 67108864

``weights``: per server count, model size and subscriber mode, the median over rounds of
each tree's push time and of its ratio to the raw broadcast timed beside it, and this
tree's over the base's; with ``--sharded``, per model size, the sharded trainer's push
and its ratio to the hand-made gather-and-broadcast. ``recovery``: per mode, the
median seconds from a SIGKILL to the new world, each tree's, and this tree's over the
base's. Writes ``bench/out/compare-<bench>.json`` with every round's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BENCHES = {"weights": "bench_weights.py", "recovery": "bench_recovery.py"}


def run_bench(tree: Path, bench: str, args: list[str], out: Path) -> Any:
    """One run of ``bench`` in ``tree`` (its own agang); its figures."""
    script = tree / "bench" / BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    extra = ["--out", str(out)] if bench == "weights" else []
    subprocess.run(
        [sys.executable, str(script), *args, *extra], cwd=tree, env=env, check=True, timeout=3600
    )
    if bench == "weights":
        name = "weights_sharded.json" if "--sharded" in args else "weights.json"
        return json.loads((out / name).read_text())["rows"]
    return json.loads((tree / "bench" / "out" / "recovery.json").read_text())


def summary(bench: str, runs: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Per cell, each tree's medians over its runs, and this tree's over the base's."""
    cells: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for label, results in runs.items():
        for result in results:
            for row in result:
                cell: tuple[Any, ...]
                if bench == "weights" and "servers" not in row:  # --sharded: 1 server
                    cell = ("sharded", row["bytes"])
                    values = {"push": row["push"], "ratio": row["ratio"]}
                elif bench == "weights":
                    cell = (row["servers"], row["bytes"], row["mode"])
                    values = {"push": row["push"], "ratio": row["ratio"]}
                else:
                    cell = (row["mode"],)
                    values = {"seconds": row["seconds"]}
                for name, value in values.items():
                    cells.setdefault(cell, {}).setdefault(f"{label} {name}", []).append(value)
    rows = []
    for cell, series in sorted(cells.items()):
        medians = {name: statistics.median(values) for name, values in series.items()}
        first = "push" if bench == "weights" else "seconds"
        base, head = medians.get(f"base {first}"), medians.get(f"head {first}")
        change = None if base in (None, 0) or head is None else head / base
        rows.append({"cell": list(cell), **medians, "head/base": change})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("base", help="the base commit (any git revision)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each tree, taking turns")
    parser.add_argument("bench", choices=sorted(BENCHES))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the bench's own arguments")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, but is {args.runs}")
    with tempfile.TemporaryDirectory(prefix="agang-compare-") as scratch:
        base_tree = Path(scratch) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), args.base],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"base": base_tree, "head": REPO}
            runs: dict[str, list[Any]] = {"base": [], "head": []}
            for index in range(args.runs):
                order = ["base", "head"] if index % 2 == 0 else ["head", "base"]
                for label in order:
                    print(f"== run {index + 1}/{args.runs}: {label}", flush=True)
                    out = Path(scratch) / label / str(index)
                    runs[label].append(run_bench(trees[label], args.bench, args.args, out))
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                check=False,
                capture_output=True,
            )
    rows = summary(args.bench, runs)
    print(f"\n{args.bench}: {args.base} (base) against this tree (head), {args.runs} runs each")
    for row in rows:
        figures = "  ".join(
            f"{name} {value * 1e3:.2f} ms" if "push" in name or "seconds" in name else
            f"{name} {value:.2f}x"
            for name, value in row.items()
            if name not in ("cell", "head/base")
        )  # fmt: skip
        change = row["head/base"]
        shown = "n/a" if change is None else f"{change:.2f}x"
        print(f"  {' / '.join(map(str, row['cell']))}: {figures}; head/base {shown}")
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / f"compare-{args.bench}.json").write_text(
        json.dumps({"base": args.base, "runs": runs, "summary": rows}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
