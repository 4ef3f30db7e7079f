"""``bench/bench_p2p.py`` times both modes and splits agang's latency: a short run (6
timed rounds) writes every sample kind with sensible values, and says the ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_short_run_times_both_modes_and_splits_agangs_latency(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/bench_p2p.py", "--rounds", "26", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agang / c10d: latency" in done.stdout, done.stdout
    result = json.loads((tmp_path / "p2p.json").read_text())
    assert result["bytes"] == 1024
    assert result["rounds"] == 26
    one, zero = result["rank1"], result["rank0"]
    assert set(one) == {"agang: c10d's thread has it", "agang: task goes on", "c10d: code goes on"}
    assert set(zero) == {"agang: call returned", "c10d: call returned"}
    for stats in [*one.values(), *zero.values()]:
        assert stats["count"] == 6  # 26 rounds, the first 20 left out
        assert 0 < stats["median_us"] <= stats["p90_us"] < 5e6
    # c10d's thread learns of the receive before the task that awaits it goes on.
    assert one["agang: c10d's thread has it"]["median_us"] < one["agang: task goes on"]["median_us"]
