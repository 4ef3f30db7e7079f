"""examples/sharded_weight_sync.py as the weights guide runs it: an FSDP2 trainer of 2
ranks under torchrun pushes to a whole-tensor server and a sharded server of 2 ranks,
every version exact on both."""

from __future__ import annotations

import re

import pytest
from scriptrun import ROOT, alive, ended_pids, run_script

pytestmark = pytest.mark.gloo

SCRIPT = ROOT / "examples" / "sharded_weight_sync.py"
PUSH = re.compile(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+(.*)$")


@pytest.mark.timeout(150)
def test_an_fsdp2_trainer_under_torchrun_delivers_every_version_exact() -> None:
    run = run_script(SCRIPT, ["--trainer-ranks", "2", "--server-ranks", "2"], timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "sharded weight sync ok: every check held" in run.stdout, run.stdout
    pushes = [m.groups() for line in run.stdout.splitlines() if (m := PUSH.match(line))]
    assert len(pushes) >= 6, run.stdout
    assert pushes[-1][1] == "sharded, whole", run.stdout
    last = pushes[-1][0]
    for name in ("whole", "sharded"):  # each took the last version (it may join late)
        took = re.search(rf"^{name} took: (.*)$", run.stdout, re.MULTILINE)
        assert took is not None, run.stdout
        assert took.group(1).split(", ")[-1] == f"v{last}", run.stdout
    assert not any(alive(pid) for pid in ended_pids(run.stdout)), run.stdout


def test_its_arguments_are_checked() -> None:
    run = run_script(SCRIPT, ["--trainer-ranks", "0"], timeout=60)
    assert run.returncode == 2, run.stdout
    assert "--trainer-ranks must be at least 1" in run.stderr, run.stderr
