"""examples/elastic_trainer.py as docs/guides/elastic.md runs it: 4 workers, rank 2 SIGKILLed
at step 20, the survivors reform, a replacement joins; and its arguments are checked.

The script starts its own ``agang store`` and workers and ends them by pid; the test
ends the script by pid if it outlives its timeout, and checks that every process the
script says it started is gone.
"""

from __future__ import annotations

import re

import pytest
from scriptrun import ROOT, alive, ended_pids, load_script, run_script

pytestmark = pytest.mark.gloo

SCRIPT = ROOT / "examples" / "elastic_trainer.py"
COMMAND = ["--workers", "4", "--kill", "2", "--at-step", "20", "--respawn"]  # the guide's
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(.*)$")  # step, epoch, size, event


@pytest.mark.timeout(120)
def test_the_readme_command_recovers_admits_a_replacement_and_learns() -> None:
    run = run_script(SCRIPT, COMMAND, timeout=90, grace=15)
    print(run.stdout)
    assert run.returncode == 0, (run.stdout, run.stderr)
    rows = [m.groups() for line in run.stdout.splitlines() if (m := ROW.match(line))]
    epochs = [(int(epoch), int(size)) for _, epoch, size, event in rows if "done" not in event]
    assert epochs == [(0, 4), (1, 3), (2, 4)], run.stdout
    recovered = re.search(r"the survivors reformed ([\d.]+) s after the SIGKILL", run.stdout)
    assert recovered is not None, run.stdout
    assert float(recovered.group(1)) < 10.0  # under the 10 s op deadline: not waited out
    assert re.search(r"rank 2 \(pid \d+\) SIGKILLed", run.stdout), run.stdout
    assert "a replacement joined at a step boundary" in run.stdout, run.stdout
    joined_at = int(rows[2][0])
    assert 20 < joined_at < 200, run.stdout
    done = re.search(r"loss ([\d.]+) at step 0, ([\d.]+) at step 199", run.stdout)
    assert done is not None, run.stdout
    assert float(done.group(2)) < 0.5 * float(done.group(1)), run.stdout  # the loss fell
    pids = ended_pids(run.stdout)
    assert len(pids) == 6  # the store, 4 workers, the replacement
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--kill", "4", "--at-step", "5"], "--kill must be a rank from 0 to 3"),
        (["--kill", "1"], "--kill and --at-step go together"),
        (["--respawn"], "--respawn replaces a killed worker"),
        (["--kill", "1", "--at-step", "200"], "--at-step must be from 0 to --steps - 1 (199)"),
        (["--workers", "0"], "--workers must be between 1 and 64"),
        (["--workers", "2", "--min-size", "2", "--kill", "0", "--at-step", "1"], "--min-size"),
        (["--op-timeout", "0"], "--op-timeout must be positive"),
    ],
)
def test_arguments_are_checked_and_the_error_names_the_parameter(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_script(SCRIPT).parse(arguments)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
