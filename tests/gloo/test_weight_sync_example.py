"""examples/weight_sync.py as the README and docs/guides/weights.md run it: a trainer
pushes to two HTTP inference servers, s1 is SIGKILLed at a push and respawned; and its
arguments are checked.

The script starts its own ``agang store``, trainer and servers and ends them by pid; the
test ends the script by pid if it outlives its timeout, and checks that every process the
script says it started is gone.
"""

from __future__ import annotations

import re

import pytest
from scriptrun import ROOT, alive, ended_pids, load_script, run_script

from agang._weights.admission import RECOVERY_SECONDS

pytestmark = pytest.mark.gloo

SCRIPT = ROOT / "examples" / "weight_sync.py"
COMMAND = ["--kill", "--respawn"]  # the README's
PUSH = re.compile(r"^\s*[\d.]+\s+push v(\d+)\s+([\d.]+) s\s+loss [\d.]+\s+delivered (.*)$")
NO_ANSWER = "no answer (dead, stopped, or cut off from the store)"


def _served(stdout: str, name: str) -> list[int]:
    """The versions the client saw ``name`` serve, in order (the summary's line)."""
    line = re.search(rf"^  {re.escape(name)}: (.*)$", stdout, re.MULTILINE)
    assert line is not None, (name, stdout)
    return [int(v) for v in re.findall(r"v(\d+):\d+", line.group(1))]


@pytest.mark.timeout(120)
def test_a_killed_server_is_dropped_with_why_and_its_respawn_serves_the_last_version() -> None:
    run = run_script(SCRIPT, COMMAND, timeout=90)
    print(run.stdout)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "weight sync ok: every check held" in run.stdout, run.stdout
    lines = run.stdout.splitlines()
    pushes = [(i, m.groups()) for i, line in enumerate(lines) if (m := PUSH.match(line))]
    assert len(pushes) >= 10, run.stdout
    versions = [int(version) for _, (version, _, _) in pushes]
    assert versions == sorted(versions), run.stdout

    # The kill: at push 4 (the default --kill-at), which drops s1 and says why.
    killed = re.search(r"s1 SIGKILLed \(pid (\d+)\) as push v(\d+) begins", run.stdout)
    assert killed is not None, run.stdout
    assert int(killed.group(2)) == versions[3], run.stdout
    at, (_, seconds, delivered) = pushes[3]
    assert delivered.split() == ["s0"], run.stdout
    assert lines[at + 1].strip().startswith(f"dropped s1: {NO_ANSWER}"), run.stdout
    assert float(seconds) < 2.0 + RECOVERY_SECONDS + 1.5, run.stdout  # deadline, recovery, slack

    # The respawn: it opens under the same name, joins at a later push, and is served.
    assert "s1 respawned under its name" in run.stdout, run.stdout
    assert "s1 (respawned) subscribed to channel 'policy'" in run.stdout, run.stdout
    joined = [n for n, (_, (_, _, d)) in enumerate(pushes) if "(joined: s1)" in d]
    assert len(joined) == 1, run.stdout
    assert joined[0] > 3, run.stdout
    assert all(d.split()[:2] == ["s0", "s1"] for _, (_, _, d) in pushes[joined[0] :]), run.stdout

    # What the client saw: versions that never go back, the last one on every live server.
    done = re.search(r"trainer done: last version v(\d+)", run.stdout)
    assert done is not None, run.stdout
    last = int(done.group(1))
    assert last == versions[-1], run.stdout
    for name in ("s0", "s1", "s1 (respawned)"):
        served = _served(run.stdout, name)
        assert served == sorted(served), (name, run.stdout)
    assert _served(run.stdout, "s0")[-1] == last, run.stdout
    assert _served(run.stdout, "s1 (respawned)")[-1] == last, run.stdout
    assert _served(run.stdout, "s1")[-1] < versions[3], run.stdout  # killed before v80

    # The trainer's close is a normal end: no server says it lost the channel.
    assert "lost the channel" not in run.stdout + run.stderr, run.stdout

    pids = ended_pids(run.stdout)
    assert len(pids) == 5  # the store, the trainer, s0, s1, the respawned s1
    assert int(killed.group(1)) in pids
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--respawn"], "--respawn replaces the killed server: it needs --kill"),
        (["--kill", "--kill-at", "10"], "--kill-at (10) must be below --pushes (10)"),
        (["--every", "0"], "--every must be at least 1"),
        (["--push-timeout", "0"], "--push-timeout must be positive"),
        (["--step-seconds", "-1"], "--step-seconds must be at least 0"),
    ],
)
def test_arguments_are_checked_and_the_error_names_the_parameter(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        load_script(SCRIPT).parse(arguments)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
