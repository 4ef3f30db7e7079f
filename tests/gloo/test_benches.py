"""The benches finish without matplotlib (it is only in the dev extra): each prints its
table and writes its JSON, says in one line that it drew no plot, and writes none.

Each plotting bench runs in its smallest mode (``--smoke``) in a subprocess whose
``sitecustomize`` makes ``import matplotlib`` fail; its files go to a temporary ``--out``
directory, never to bench/out. The four start together (most of their time is start-up,
spent waiting), and each test checks its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NO_PLOT = "matplotlib is not installed: no "

BLOCKER = '''
"""Makes every import of matplotlib fail, as where it is not installed."""
import sys


class _NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoMatplotlib())
'''


@pytest.fixture(scope="module")
def without_matplotlib(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose Python processes cannot import matplotlib."""
    site = tmp_path_factory.mktemp("no_matplotlib")
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_blocker_blocks(without_matplotlib: dict[str, str]) -> None:
    result = _run(["-c", "import matplotlib"], without_matplotlib, 30)
    assert result.returncode == 1
    assert "ModuleNotFoundError: No module named 'matplotlib'" in result.stderr


#: Script -> (its smallest mode, a line of its table, its JSON file).
BENCHES = {
    "bench_latency.py": (["--smoke", "--sizes", "4"], "Targets (median ratio", "latency.json"),
    "bench_training.py": (["--smoke"], "| mode | median step |", "training.json"),
    "bench_scheduler.py": (["--smoke"], "1. Coalescing: 64 all_reduces", "scheduler.json"),
    "bench_overhead.py": (["--smoke", "--profile", "10"], "| loop | stage |", "overhead.json"),
}


@dataclass
class Run:
    """One bench started without matplotlib, writing into ``out``."""

    process: subprocess.Popen[str]
    out: Path


@pytest.fixture(scope="module")
def bench_runs(
    without_matplotlib: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Run]]:
    """Every plotting bench, started at once; killed with its ranks at the end if still
    running (a test selected alone leaves the others unread)."""
    runs = {}
    for script, (args, _, _) in BENCHES.items():
        out = tmp_path_factory.mktemp(script.removesuffix(".py"))
        process = subprocess.Popen(
            [sys.executable, str(BENCH / script), *args, "--out", str(out)],
            env=without_matplotlib,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its ranks join its group: killed with it
        )
        runs[script] = Run(process, out)
    yield runs
    for run in runs.values():
        if run.process.poll() is None:
            # The bench's ranks hold its pipes open: end the whole group, not the parent
            # alone (which would leave them running, and communicate() waiting on them).
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.communicate()


@pytest.mark.parametrize("script", list(BENCHES))
def test_a_bench_prints_and_writes_everything_but_plots_without_matplotlib(
    bench_runs: dict[str, Run], script: str
) -> None:
    _, table, document = BENCHES[script]
    run = bench_runs[script]
    stdout, stderr = run.process.communicate(timeout=120)
    assert run.process.returncode == 0, stdout + stderr
    assert table in stdout, stdout
    assert json.loads((run.out / document).read_text())
    assert len([line for line in stdout.splitlines() if NO_PLOT in line]) == 1, stdout
    assert "Traceback" not in stderr, stderr
    assert list(run.out.glob("*.png")) == []


def test_plot_scheduler_says_it_cannot_plot_without_matplotlib(
    without_matplotlib: dict[str, str], tmp_path: Path
) -> None:
    source = _scheduler_document(tmp_path)
    result = _run([str(BENCH / "plot_scheduler.py"), str(source), str(tmp_path)],
                  without_matplotlib, 30)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stdout.strip() == (
        f"{NO_PLOT}coalesce.png, scheduler_lag.png (pip install matplotlib to plot)."
    )
    assert list(tmp_path.glob("*.png")) == []


def test_plot_scheduler_still_plots_with_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip(
        "matplotlib", reason="matplotlib (the dev extra) is not installed: nothing to plot with"
    )
    source = _scheduler_document(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = _run([str(BENCH / "plot_scheduler.py"), str(source), str(tmp_path)], env, 60)
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in tmp_path.glob("*.png")) == [
        "coalesce.png",
        "scheduler_lag.png",
    ]


def _scheduler_document(tmp_path: Path) -> Path:
    """A minimal ``scheduler.json``, shaped as ``bench_scheduler.py`` writes it."""
    stats = {"median": 0.002, "p90": 0.003, "p99": 0.004, "max": 0.005}
    counts = [1, 100]
    lag = {"idle": {"lag": stats}}
    lag |= {f"4096/{count}/agang asyncio": {"lag": stats} for count in counts}
    document = {
        "plan": {"lag_sizes": [4096]},
        "lag_counts": counts,
        "lag_modes": ["agang asyncio"],
        "lag_target_s": 0.005,
        "ranks": [{"coalesce": {"agang coalesce()": stats, "c10d one by one": stats}, "lag": lag}],
    }
    source = tmp_path / "scheduler.json"
    source.write_text(json.dumps(document))
    return source


def test_bench_pending_wait_measures_every_mode_and_loop(tmp_path: Path) -> None:
    # It draws no plot: its table and JSON are all it writes.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = _run([str(BENCH / "bench_pending_wait.py"), "--smoke", "--out", str(tmp_path)],
                  env, 120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads((tmp_path / "pending_wait.json").read_text())["rows"]
    modes = {(row["wait_mode"], row["loop"]) for row in rows}
    assert modes == {(mode, loop) for mode in ("park", "block_briefly")
                     for loop in ("asyncio", "uvloop", "trio")}  # fmt: skip
    assert {row["num_ops"] for row in rows} == {100, 1}
    assert all(row["pending"] > 0 and row["loop_cpu"] >= 0 for row in rows)
    assert "(loop < 2% of a core)" in result.stdout


def test_bench_nccl_sim_prints_every_mode_and_agangs_own_parts() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = _run([str(BENCH / "bench_nccl_sim.py"), "--ops", "5", "--rounds", "1"], env, 120)
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("raw ", "agang ", "agang stream-ordered", "instant device", "issue ",
                "poll that learns the end", "await of a finished handle", "loop pass",
                "Interleaving", "in one loop"):  # fmt: skip
        assert row in result.stdout, result.stdout
