"""A process's world gang, and who may use it: forked children, and a second init.

Real Gloo worlds in spawned processes. Each rank, and each program, reports through its
exit code and one line of JSON on stdout (read with ``capfd``, which also sees what the
ranks' forked children write). Bounds keep a 10x margin between pass and fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
from test_gloo_faults import _exit_codes_of_two_ranks, _world_gang_of_two

import agang

pytestmark = pytest.mark.gloo

NUM_OPS = 100
# 100 all_reduces of 4 floats take about 0.2 s here (each rank reports its `ops_took`).
OPS_BOUND = 10.0


def _child_returns(gang: agang.Gang) -> int:
    return 0  # the caller returns from the rank's function: a normal interpreter exit


def _child_calls_sys_exit(gang: agang.Gang) -> int:
    sys.exit(0)


def _child_tries_the_gang(gang: agang.Gang) -> int:
    import anyio

    refused = 0
    calls = [
        lambda: gang.all_reduce(torch.ones(4)),
        lambda: gang.barrier(),
        lambda: anyio.run(gang.lane, "side"),
        lambda: anyio.run(gang.create_gang, [0]),
    ]
    for call in calls:
        try:
            call()
        except agang.GangInheritedError as error:
            refused += "before a fork" in str(error) and "agang.init()" in str(error)
    gang.close_sync()  # the parent's gang: nothing happens to it
    if refused != len(calls) or not gang.closed:
        return 3
    # A gang of its own: a world of one over Gloo, not the parent's group wrapped.
    own = agang.init_sync(in_process=False, env={}, timeout=30)
    total = own.all_reduce(torch.ones(1)).wait(timeout=30)
    own.close_sync()
    return 0 if own.size == 1 and total.item() == 1.0 else 4


def _rank_that_forks(rank: int, port: int) -> None:
    gang = _world_gang_of_two(rank, port)
    gang.all_reduce(torch.ones(1)).wait(timeout=60)
    children: dict[str, int] = {}
    if rank == 0:
        pids = {}
        for child in (_child_returns, _child_calls_sys_exit, _child_tries_the_gang):
            pid = os.fork()
            if pid == 0:
                code = child(gang)
                if code:
                    sys.exit(code)
                return  # a normal exit, through the interpreter's exit hooks
            pids[child.__name__] = pid
        for name, pid in pids.items():  # all three live at once, beside the parent's gang
            children[name] = os.waitpid(pid, 0)[1]
    gang.barrier().wait(timeout=60)  # rank 1 waits here for rank 0's children
    started = time.monotonic()
    for _ in range(NUM_OPS):
        tensor = torch.full((4,), float(rank + 1))
        gang.all_reduce(tensor).wait(timeout=30)
        assert tensor.tolist() == [3.0] * 4, tensor
    report = {"rank": rank, "ops_took": time.monotonic() - started, "children": children}
    os.write(1, f"REPORT {json.dumps(report)}\n".encode())  # one write: ranks share stdout
    gang.close_sync()


def _run_program(source: str) -> subprocess.CompletedProcess[str]:
    """Runs ``source`` (indented Python) in a fresh interpreter; its output, captured."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _reports(text: str) -> list[dict[str, Any]]:
    lines = [line for line in text.splitlines() if line.startswith("REPORT ")]
    return [json.loads(line.removeprefix("REPORT ")) for line in lines]


def test_fork_after_init_leaves_the_parent_unaffected(capfd: pytest.CaptureFixture[str]) -> None:
    """A child forked after init that exits (returning, or by ``sys.exit``) leaves the
    parent's gang alone, and one that tries the inherited gang gets a clear error and
    can make a gang of its own. Before, the child's exit closed the parent's gang (exit
    hung 5 s, "threads still busy"; the parent's ops slowed or desynchronised), and a
    child's op ran on the parent's connections (the parent aborted)."""
    exit_codes = _exit_codes_of_two_ranks(_rank_that_forks)
    out, err = capfd.readouterr()

    assert exit_codes == [0, 0], err
    reports = sorted(_reports(out), key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == [0, 1], out
    children = reports[0]["children"]
    assert children == dict.fromkeys(children, 0), (children, err)
    assert len(children) == 3
    assert all(report["ops_took"] < OPS_BOUND for report in reports), reports
    for sign in ("still busy", "Traceback", "terminate called", "failed"):
        assert sign not in err, err


INIT_TWICE = """
    import anyio, torch, agang

    world = dict(in_process=False, env={}, timeout=30)
    first = agang.init_sync(**world)
    refusals = []
    seconds = [lambda: agang.init_sync(**world), lambda: anyio.run(lambda: agang.init(**world))]
    for second in seconds:
        try:
            second()
        except agang.GangInitError as error:
            refusals.append(str(error))
    # Nor an in-process one, while the world gang is open: one gang from init at a time.
    try:
        agang.init_sync(env={})
    except agang.GangInitError as error:
        refusals.append(str(error))
    lane = anyio.run(first.lane, "side")
    sub = anyio.run(first.create_gang, [0])
    total = first.all_reduce(torch.ones(1)).wait(timeout=30).item()
    first.close_sync()
    first.close_sync()  # twice is harmless
    closed_refuse = []
    for gang in (first, lane, sub):
        try:
            gang.all_reduce(torch.ones(1))
        except agang.GangClosedError:
            closed_refuse.append(gang.name)
    again = anyio.run(lambda: agang.init(**world))  # after close, init works again
    again_total = again.all_reduce(torch.ones(1)).wait(timeout=30).item()
    again.close_sync()
    print("REPORT " + __import__("json").dumps({
        "refusals": refusals, "total": total,
        "closed_refuse": closed_refuse, "again": again_total,
    }))
"""


def test_init_twice_is_refused_while_the_world_gang_is_open() -> None:
    """Before, a second init wrapped the same world again: two gangs numbering their ops
    apart over one communicator, one of them left open on a destroyed group."""
    result = _run_program(INIT_TWICE)

    assert result.returncode == 0, result.stderr
    [report] = _reports(result.stdout)
    assert len(report["refusals"]) == 3, report  # init_sync, init, then in-process
    for message in report["refusals"]:
        assert "world gang 'root' (rank 0 of 1, gloo) is still open" in message
        assert "Close it first" in message
    assert report["total"] == 1.0
    assert report["closed_refuse"] == ["root", "root/lane:side", "root[0]"], report
    assert report["again"] == 1.0
    assert "Traceback" not in result.stderr


INIT_TWICE_IN_PROCESS = """
    import anyio, torch, agang

    first = agang.init_sync(env={})  # no launcher: an in-process gang
    refusals = []
    world = dict(in_process=False, env={}, timeout=30)
    seconds = [
        lambda: agang.init_sync(env={}),
        lambda: anyio.run(lambda: agang.init(env={})),
        lambda: agang.init_sync(**world),
    ]
    for second in seconds:
        try:
            second()
        except agang.GangInitError as error:
            refusals.append(str(error))
    total = first.all_reduce(torch.ones(1)).wait(timeout=30).item()
    first.close_sync()
    again = agang.init_sync(env={})  # after close, init works again
    again_total = again.all_reduce(torch.ones(1)).wait(timeout=30).item()
    again.close_sync()
    print("REPORT " + __import__("json").dumps({
        "refusals": refusals, "name": first.name, "total": total, "again": again_total,
    }))
"""


def test_init_twice_is_refused_in_process_as_under_a_launcher() -> None:
    """A second init while the first one's in-process gang is open is refused with the
    same error as under torchrun (before, it made a second gang in process and was
    refused only with a world): a program behaves one way, however it is started."""
    result = _run_program(INIT_TWICE_IN_PROCESS)

    assert result.returncode == 0, result.stderr
    [report] = _reports(result.stdout)
    assert len(report["refusals"]) == 3, report  # in-process twice, then a world
    for message in report["refusals"]:
        assert f"world gang '{report['name']}' (rank 0 of 1, in-process) is still open" in message
        assert "Close it first" in message
    assert report["total"] == 1.0
    assert report["again"] == 1.0
    assert "Traceback" not in result.stderr


CHILD_LEAVES_THROUGH_THE_LOOP = """
    import asyncio, json, os, sys, time
    import anyio, torch, agang

    async def main():
        gang = await agang.init(in_process=False, env={}, timeout=30)
        await gang.all_reduce(torch.ones(1))
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # through asyncio.run's teardown: the child's loop is closed
        status = os.waitpid(pid, 0)[1]
        started = time.monotonic()
        outcome = "ok"
        try:
            with anyio.fail_after(8):
                for _ in range(20):
                    await gang.all_reduce(torch.ones(1))
        except TimeoutError:
            outcome = "hung"
        took = time.monotonic() - started
        await gang.close()
        print("REPORT " + json.dumps({"outcome": outcome, "took": took, "child": status}))

    asyncio.run(main())
"""


def test_a_child_leaving_through_its_loops_teardown_leaves_the_parents_loop_awake() -> None:
    """The child's loop is the parent's, copied, with a shared epoll instance and
    self-pipe: closing it in the child once left the parent's loop deaf to its own
    threads, so 20 awaited all-reduces of a world of one took 5 s or never finished
    (the bound below); now they take about 10 ms."""
    result = _run_program(CHILD_LEAVES_THROUGH_THE_LOOP)

    assert result.returncode == 0, result.stderr
    [report] = _reports(result.stdout)
    assert report["child"] == 0, report
    assert report["outcome"] == "ok", report
    assert report["took"] < 2.0, report
