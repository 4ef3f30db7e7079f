"""``agang selfcheck``: the command on this CPU (the simulation), and its table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agang._cli.selfcheck.checks import CHECKS, run_checks
from agang._cli.selfcheck.harness import Harness, SimulatedHarness
from agang._cli.selfcheck.report import Result, Row, merge, passed, render


@pytest.mark.slow  # runs the command in a process of its own
def test_selfcheck_without_a_gpu_runs_the_simulation_and_passes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agang", "selfcheck"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("agang selfcheck: simulated NCCL, 2 ranks on this CPU")
    results = {line.split()[0]: line.split()[1] for line in lines[3:] if len(line.split()) > 1}
    for name, _ in CHECKS:
        assert results[name] == ("SKIP" if name == "private_streams" else "PASS"), name
    assert lines[-1] == f"all {len(CHECKS) - 1} checks passed"
    # As on a GPU, the simulated abort waits for the stalled rank's own device, so the
    # close checks count close's time from when that device got past its stall.
    figures = {line.split()[0]: line for line in lines[3:] if len(line.split()) > 1}
    for name in ("timeout_then_abort", "close"):
        assert "after this rank's own stalled device got past it" in figures[name], name
    assert "broken" not in done.stderr  # the expected breaks are not logged by default


@pytest.mark.anyio
async def test_a_check_that_raises_or_says_fail_fails_the_run() -> None:
    async def raises(h: Harness) -> tuple[Result, str]:
        raise RuntimeError("boom")

    async def fails(h: Harness) -> tuple[Result, str]:
        return "FAIL", "wrong"

    harness = SimulatedHarness()
    try:
        rows = await run_checks(harness, [("raises", raises), ("fails", fails)])
    finally:
        await harness.close()
    assert rows == [Row("raises", "FAIL", "RuntimeError: boom"), Row("fails", "FAIL", "wrong")]
    assert not passed(rows)


def test_rows_merge_across_ranks_and_render() -> None:
    rank0 = [Row("a", "PASS", "1 ms"), Row("b", "PASS", "x"), Row("c", "SKIP", "n/a")]
    rank1 = [Row("a", "PASS", "2 ms"), Row("b", "FAIL", "late"), Row("c", "SKIP", "n/a")]
    merged = merge([rank0, rank1])
    assert merged == [Row("a", "PASS", "1 ms"), Row("b", "FAIL", "rank 1: late"), rank0[2]]
    assert not passed(merged)
    table = render("title", merged)
    assert table.splitlines()[-1] == "FAILED: 1 of 2 checks (b)"
    assert passed(rank0)
    assert render("t", rank0).splitlines()[-1] == "all 2 checks passed"
    assert not passed([Row("c", "SKIP", "n/a")])  # nothing ran: not a pass
