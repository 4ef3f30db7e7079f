"""Aborting a Gloo group ends its running work (``agang._backends.c10d.abort``), on real Gloo ranks.

One world of two ranks, each part on a lane of its own so that an abort breaks only
that lane; then worlds of three and four ranks (``tests/support/gloo_abort_rank.py``)
in which rank 0 aborts after rank 1, the next rank after it, aborted, was killed, or
stays away. Bounds keep a 10x margin: an abort ends work in milliseconds, while work
that is not aborted runs until the peer's connections close (here: never, within the
test) or c10d's own timeout (60 s or more).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import torch.distributed as dist
from gloo_abort_rank import OBSERVE
from storeutil import SUPPORT, Spawned

import agang
from agang._backends.c10d.abort import abort_group
from agang.testing import run_world

pytestmark = pytest.mark.gloo

SETTLE = 0.3  # long enough for a healthy abort to have ended the work
PROMPT = 1.0  # an abort ends work well within this
TIMEOUT = 0.5  # the agang deadline in part B


def _wait_for_error(work: Any) -> str | None:
    """Blocks until ``work`` ends; its error's text, or None when it succeeded."""
    try:
        work.wait()
    except Exception as error:
        return str(error)
    return None


async def _raw_abort(gang: agang.Gang) -> dict[str, Any]:
    """Part A, raw c10d on a lane's group: rank 0 starts an all_reduce that rank 1 never
    joins, calls Gloo's own ``abort()``, then ``abort_group``; rank 1 waits meanwhile on
    a recv from rank 0 that rank 0 never sends."""
    assert isinstance(gang, agang.ProcessGroupGang)
    group = gang.process_group
    started = time.monotonic()
    if gang.rank == 1:
        work = group.recv([torch.empty(1)], 0, 7)
        error = await anyio.to_thread.run_sync(_wait_for_error, work)
        return {"peer_error": error, "peer_waited": time.monotonic() - started}
    work = group.allreduce([torch.ones(4)])
    await anyio.sleep(SETTLE)
    group.abort()
    await anyio.sleep(SETTLE)
    running_after_gloo_abort = not work.is_completed()
    aborting_at = time.monotonic()
    abort_group(group, "gloo")
    error = await anyio.to_thread.run_sync(_wait_for_error, work)
    return {
        "running_after_gloo_abort": running_after_gloo_abort,
        "ended_after": time.monotonic() - aborting_at,
        "error": error,
    }


async def _timeout_aborts(gang: agang.Gang) -> dict[str, Any]:
    """Part B, through agang: rank 0's all_reduce misses its deadline (rank 1 never
    joins it), so the lane breaks and aborts its group (``on_timeout="abort"``)."""
    started = time.monotonic()
    if gang.rank == 1:
        try:
            await gang.recv(torch.empty(4), 0)  # rank 0 never sends: only an abort ends it
        except agang.GangError as error:
            return {"peer_error": type(error).__name__, "peer_waited": time.monotonic() - started}
        return {"peer_error": None}
    tensor = torch.ones(4)
    with contextlib.suppress(agang.GangTimeoutError):
        await gang.all_reduce(tensor, timeout=TIMEOUT)
    timed_out_at = time.monotonic()
    # The registry of busy memory is process-wide: a FakeGang sees the lane's claim.
    probe = agang.FakeGang(rank=0, size=2)
    freed_after = None
    with anyio.move_on_after(10 * PROMPT):
        while True:
            try:
                await probe.all_reduce(tensor)
            except agang.TensorBusyError:
                await anyio.sleep(0.01)
                continue
            freed_after = time.monotonic() - timed_out_at
            break
    return {"freed_after": freed_after, "timed_out": gang.statistics().num_timed_out}


async def _both_parts(gang: agang.Gang) -> dict[str, Any]:
    raw = await gang.lane("raw")
    timeout = await gang.lane("timeout")
    report = {"raw": await _raw_abort(raw), "timeout": await _timeout_aborts(timeout)}
    await gang.barrier()  # the root gang is untouched by its lanes' aborts
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    return run_world(_both_parts, 2, async_backend="asyncio", timeout=60.0)


def test_gloo_abort_alone_leaves_running_work_running(reports: list[dict[str, Any]]) -> None:
    """The c10d fact that ``_abort`` rests on (torch 2.13): ``ProcessGroup.abort()`` on
    Gloo does not end an all_reduce in progress. If a newer torch ends it, this test
    fails, and the receive trick in ``_abort`` may go."""
    assert reports[0]["raw"]["running_after_gloo_abort"]


def test_abort_group_ends_running_work_at_once(reports: list[dict[str, Any]]) -> None:
    raw = reports[0]["raw"]

    assert raw["ended_after"] < PROMPT
    assert raw["error"] is not None  # it failed, it did not complete


def test_the_peer_of_an_aborting_rank_fails_instead_of_hanging(
    reports: list[dict[str, Any]],
) -> None:
    """Rank 1's recv from rank 0 fails once rank 0 aborts (about 2 x SETTLE in)."""
    raw = reports[1]["raw"]

    assert raw["peer_error"] is not None
    assert raw["peer_waited"] < 2 * SETTLE + PROMPT


def test_a_timed_out_op_is_ended_and_its_tensor_freed(reports: list[dict[str, Any]]) -> None:
    """With ``on_timeout="abort"`` the op is really ended, not only given up on: its
    tensor is free again promptly, and the peer's op with this rank fails too."""
    timeout = reports[0]["timeout"]
    peer = reports[1]["timeout"]

    assert timeout["timed_out"] == 1
    assert timeout["freed_after"] is not None
    assert timeout["freed_after"] < PROMPT
    assert peer["peer_error"] == "CollectiveError"
    assert peer["peer_waited"] < TIMEOUT + PROMPT


# Worlds of three and four ranks: rank 0 aborts while its ops wait on live peers only.


def _world(scenario: str, size: int) -> Iterator[list[dict[str, Any] | None]]:
    """Runs ``gloo_abort_rank.py`` on ``size`` ranks; each rank's report (None for the
    killed rank). Every rank is ended by its pid at the end."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )  # fmt: skip
    started: list[subprocess.Popen[str]] = []
    argv = [str(SUPPORT / "gloo_abort_rank.py"), scenario, str(size)]
    try:
        ranks = [
            Spawned(started, [*argv, str(rank), "127.0.0.1", str(store.port)])
            for rank in range(size)
        ]
        if scenario == "killed":
            ranks[1].out.wait_for("victim ready", 60)
            ranks[1].kill()
            store.set("victim", str(time.time()))
        reports: list[dict[str, Any] | None] = []
        for rank, spawned in enumerate(ranks):
            if scenario == "killed" and rank == 1:
                reports.append(None)
                continue
            line = spawned.out.wait_for('{"rank"', 60)
            reports.append(json.loads(line))
        yield reports
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def after_abort() -> Iterator[list[dict[str, Any] | None]]:
    """Three ranks; rank 1 aborted first."""
    yield from _world("aborted", 3)


@pytest.fixture(scope="module")
def after_kill() -> Iterator[list[dict[str, Any] | None]]:
    """Four ranks; rank 1 was SIGKILLed."""
    yield from _world("killed", 4)


@pytest.fixture(scope="module")
def beside_absent() -> Iterator[list[dict[str, Any] | None]]:
    """Four ranks; rank 1 is alive and joins nothing."""
    yield from _world("absent", 4)


def _ended(report: dict[str, Any] | None, name: str) -> dict[str, Any]:
    assert report is not None
    end: dict[str, Any] | None = report["ends"].get(name)
    assert end is not None, f"{name} did not end within {OBSERVE} s of the abort: {report}"
    return end


@pytest.mark.parametrize("world", ["after_abort", "after_kill"])
def test_an_abort_ends_work_on_live_pairs_when_the_next_rank_is_gone(
    world: str, request: pytest.FixtureRequest
) -> None:
    """Rank 0's pair to rank 1 (the next rank) is closed already, so a receive from rank 1
    alone closes nothing: the abort must time a receive out on a live pair. Without
    that, rank 0's recv from and send to live peers never ended (Gloo's timeout: 120 s)."""
    reports = request.getfixturevalue(world)
    aborter = reports[0]

    assert "closed" in aborter["pair_to_victim"] or "reset" in aborter["pair_to_victim"]
    assert aborter["ended_before_abort"] == []  # they were pending
    assert aborter["abort_took"] < PROMPT
    for name in ("recv", "send"):
        end = _ended(aborter, name)
        assert end["after"] < OBSERVE
        assert end["error"] is not None


@pytest.mark.parametrize("world", ["after_abort", "after_kill"])
def test_the_live_peers_of_an_aborting_rank_see_their_pairs_with_it_close(
    world: str, request: pytest.FixtureRequest
) -> None:
    reports = request.getfixturevalue(world)

    for report in reports[2:]:
        end = _ended(report, "recv_from_aborter")
        assert end["after"] < OBSERVE
        assert end["error"] is not None


def test_an_abort_ends_a_collective_that_a_live_rank_never_joins(
    beside_absent: list[dict[str, Any] | None],
) -> None:
    aborter = beside_absent[0]

    assert aborter is not None
    assert aborter["ended_before_abort"] == []
    for name in ("all_reduce", "recv", "send"):
        end = _ended(aborter, name)
        assert end["after"] < OBSERVE
        assert end["error"] is not None


@pytest.mark.parametrize("world", ["after_abort", "beside_absent"])
def test_gloo_keeps_a_recv_from_any_source_through_an_abort(
    world: str, request: pytest.FixtureRequest
) -> None:
    """The c10d fact behind the abort module's rule 2 exception (torch 2.13): a
    ``recv_anysource`` waits in its context's own list, which closing the pairs does not
    touch, so it ends only at its own timeout. agang never posts one. If a newer torch
    ends it, this test fails and the rule can say so."""
    aborter = request.getfixturevalue(world)[0]

    assert "recv_anysource" not in aborter["ends"]
