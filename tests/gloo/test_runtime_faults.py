"""Runtime faults and load on real Gloo ranks (fault scenarios B* and G*).

Every program runs on two spawned local ranks (``agang.testing.run_world``, 127.0.0.1
only) and returns plain data; the assertions run here. T is the deadline in force and
eps = 0.5 s + 10 % of T, the promised slack. Time bounds keep about a 10x margin between the
passing and the failing behaviour, or sit at the promised bound.

Rows and tests (``F`` = this file, tests/gloo/test_runtime_faults.py; ``gloo_faults`` =
tests/gloo/test_gloo_faults.py):

| row | test (file::name) |
| --- | --- |
| B1 | F::test_b1_peer_killed_during_a_64_mib_all_reduce (asyncio) |
| B2 | F::test_b2_peer_exits_while_idle (trio) |
| B3 | F::test_b3_stopped_peer_times_out_and_breaks_the_gang (trio) |
| B4 | F::test_b4_straggler_at_half_the_deadline_succeeds (uvloop) |
| B5 | F::test_b5_op_timeout_shorter_than_the_default_fires_on_time (uvloop); the longer |
|    | half: gloo_faults::test_op_timeout_longer_than_the_default_is_honoured (asyncio) |
| B7 | F::test_b7_close_wakes_pending_waiters_at_once_and_exits_cleanly (trio); |
|    | F::test_b7_close_returns_within_a_second (trio); |
|    | F::test_b7_closer_exits_cleanly_when_its_peer_dies_meanwhile (asyncio) |
| B8 | F::test_b8_peer_blocking_its_loop (asyncio) |
| G  | 1,000 awaiters, issue order: F::test_g_loop_lag_with_ops_in_flight (asyncio) and |
|    | gloo_faults::test_a_thousand_ops_in_flight_complete_correctly (uvloop, trio) |
| G  | lag at 100 / 500 / 1,000 in flight: F::test_g_loop_lag_with_ops_in_flight |
| G  | mixed 64 MiB / 1 KiB: F::test_g_small_ops_are_not_starved_by_big_ones |
| G  | 5k ops: F::test_g_five_thousand_ops_leave_threads_and_fds_flat; |
|    | F::test_g_five_thousand_ops_grow_rss_under_1_mib |

Tests that share a world (B4 and B5; the first two B7 tests; the four G tests) read one
module-scoped fixture each, which saves a world's start-up (3-5 s here) apiece.

A rank that is killed, or exits on purpose, makes ``run_world`` raise ``WorldRunError``;
the survivor's report is then read from the error's ``results``. Signals only ever go to
a rank of the same world, by the pid it reported. ``run_world`` joins, or kills, every
rank it started before it returns; the tests that signal or outlive a rank also check
that its pid is gone (reaped, not a zombie).
"""

from __future__ import annotations

import atexit
import gc
import math
import os
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from census import census

import agang
from agang._backends.contract import BLAME_BOUND
from agang.testing import WorldRunError, run_world

pytestmark = pytest.mark.gloo

# 64 MiB of float32.
BIG_NUMEL = 16 * 1024 * 1024
# 1 KiB of float32.
SMALL_NUMEL = 256


def eps(timeout: float) -> float:
    """The allowance past a deadline: the blame's bound (the peers are asked where they
    stand before the error is raised), then 0.5 s + 10 % of T."""
    return BLAME_BOUND + 0.5 + 0.1 * timeout


def _process_is_gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie counts: it runs nothing any more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return fields[0] in ("Z", "X")


def _all_threads_stopped(pid: int) -> bool:
    """True once every thread of ``pid`` is stopped (SIGSTOP took effect everywhere)."""
    try:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rsplit(")", 1)[1].split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(states) and all(state == "T" for state in states)


def _process_is_reaped(pid: int) -> bool:
    """True when nothing is left of ``pid``, not even a zombie."""
    return not os.path.exists(f"/proc/{pid}")


def _refusals(gang: agang.Gang, first_error: BaseException) -> dict[str, Any]:
    """Times how a broken gang refuses three kinds of op; none may reach c10d."""
    one = torch.ones(1)
    calls: list[Callable[[], object]] = [
        lambda: gang.all_reduce(one),
        lambda: gang.barrier(),
        lambda: gang.all_gather_objects(0),
    ]
    seconds: list[float] = []
    kinds: list[str] = []
    cause_attached = True
    for call in calls:
        before = time.perf_counter()
        try:
            call()
        except agang.GangError as error:
            seconds.append(time.perf_counter() - before)
            kinds.append(type(error).__name__)
            if isinstance(error, agang.GangBrokenError):
                cause_attached &= error.first_cause is first_error
                cause_attached &= error.__cause__ is first_error
        else:
            kinds.append("issued")
    return {"kinds": kinds, "seconds": seconds, "cause_attached": cause_attached}


def _assert_refused_at_once(refusals: dict[str, Any]) -> None:
    """What "broken" promises: every later op refused at once with the first cause.

    A refusal takes microseconds (a flag check and an exception); 10 ms is the promised
    bound. The median of three calls is bounded so that one preemption of the rank on
    this shared 2-core machine cannot fail the test; the slowest still gets 100 ms.
    """
    assert refusals["kinds"] == ["GangBrokenError"] * 3
    assert refusals["cause_attached"]
    assert statistics.median(refusals["seconds"]) < 0.010
    assert max(refusals["seconds"]) < 0.100


# B1: a peer is SIGKILLed while a 64 MiB all_reduce is in flight.

B1_TIMEOUT = 2.0


async def _peer_killed_mid_op(gang: agang.Gang) -> dict[str, Any]:
    """Rank 0 SIGKILLs rank 1 while both are in a 64 MiB all_reduce (seq 1)."""
    tensor = torch.ones(BIG_NUMEL)  # allocated first, so both ranks issue together
    pids: list[int] = await gang.all_gather_objects(os.getpid())
    if gang.rank == 1:
        await gang.all_reduce(tensor)
        await anyio.sleep(60)  # only reached if the kill failed; the test then fails
        return {}
    handle = gang.all_reduce(tensor, timeout=B1_TIMEOUT)
    await anyio.sleep(0.005)
    in_flight_at_kill = not handle.done()
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    report: dict[str, Any] = {"pids": pids, "in_flight_at_kill": in_flight_at_kill}
    try:
        await handle
    except agang.GangError as error:
        report["error_after"] = time.monotonic() - killed_at
        report["error"] = type(error).__name__
        report["refusals"] = _refusals(gang, error)
    else:
        report["error"] = None
    closing_at = time.monotonic()
    await gang.close()
    report["close_took"] = time.monotonic() - closing_at
    return report


def test_b1_peer_killed_during_a_64_mib_all_reduce() -> None:
    """The survivor learns of the loss through a ``CollectiveError`` (c10d's error as its
    cause), then refuses every op, and closes within 1 s.

    Gloo sees the dead peer's connection reset within milliseconds; the bound is the
    promised T+eps (2.7 s here), and a hang would run into the world's deadline instead.
    """
    with pytest.raises(WorldRunError) as raised:
        run_world(_peer_killed_mid_op, 2, async_backend="asyncio", timeout=60.0)
    # Only the killed rank failed: the survivor reported, closed and exited with code 0.
    assert set(raised.value.failures) == {1}
    report = raised.value.results[0]

    assert report["in_flight_at_kill"]
    assert report["error"] is not None, "the op succeeded after its peer was killed"
    # The peer's loss itself, from c10d (connection reset), not the deadline passing.
    assert report["error"] == "CollectiveError"
    assert report["error_after"] < B1_TIMEOUT + eps(B1_TIMEOUT)
    _assert_refused_at_once(report["refusals"])
    assert report["close_took"] < 1.0
    assert all(_process_is_reaped(pid) for pid in report["pids"])


# B2: a peer exits while idle; the other then issues an op.

B2_TIMEOUT = 2.0


async def _peer_exits_while_idle(gang: agang.Gang) -> dict[str, Any]:
    """Rank 1 leaves (abruptly: ``os._exit``), then rank 0 issues an all_reduce."""
    pids: list[int] = await gang.all_gather_objects(os.getpid())
    if gang.rank == 1:
        os._exit(0)  # no close: the kernel closes its sockets
    with anyio.fail_after(10):
        # Polling /proc: rank 1 is not this process's child, so there is nothing to await.
        while not _process_is_gone(pids[1]):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    report: dict[str, Any] = {"pids": pids}
    started = time.monotonic()
    try:
        await gang.all_reduce(torch.ones(4), timeout=B2_TIMEOUT)
    except agang.GangError as error:
        report["elapsed"] = time.monotonic() - started
        report["error"] = type(error).__name__
        report["refusals"] = _refusals(gang, error)
    else:
        report["error"] = None
    return report


def test_b2_peer_exits_while_idle() -> None:
    """An op issued to a peer that is gone fails within T+eps (2.7 s), not at c10d's
    backstop (30 s past T) and not never."""
    with pytest.raises(WorldRunError) as raised:
        run_world(_peer_exits_while_idle, 2, async_backend="trio", timeout=60.0)
    assert set(raised.value.failures) == {1}
    report = raised.value.results[0]

    assert report["error"] is not None, "the op succeeded with its peer gone"
    assert report["elapsed"] < B2_TIMEOUT + eps(B2_TIMEOUT)
    _assert_refused_at_once(report["refusals"])
    assert all(_process_is_reaped(pid) for pid in report["pids"])


# B3: a peer is SIGSTOPped for 3T during an op.

B3_TIMEOUT = 1.0
B3_STOPPED_FOR = 3 * B3_TIMEOUT


async def _stopped_peer(gang: agang.Gang) -> dict[str, Any]:
    """Rank 0 stops rank 1 in the middle of an all_reduce (seq 1) for 3T, then resumes it."""
    pids: list[int] = await gang.all_gather_objects(os.getpid())
    if gang.rank == 1:
        started = time.monotonic()
        try:
            await gang.all_reduce(torch.ones(4))
        except agang.GangError as error:
            return {"error": type(error).__name__, "elapsed": time.monotonic() - started}
        return {"error": None}
    await anyio.sleep(0.2)  # rank 1 has issued its side and waits for ours
    os.kill(pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    # Under load a stop can take effect late: a rank 1 still running would finish the op
    # with ours (seen once with the suite on two workers). Issue ours once it is stopped.
    while not _all_threads_stopped(pids[1]) and time.monotonic() - stopped_at < 5.0:  # noqa: ASYNC110
        await anyio.sleep(0.01)  # a process state: nothing to await
    report: dict[str, Any] = {"pids": pids}
    try:
        started = time.monotonic()
        try:
            await gang.all_reduce(torch.ones(4))
        except agang.GangTimeoutError as error:
            report["elapsed"] = time.monotonic() - started
            report["context"] = (error.context.op, error.context.seq, error.context.timeout)
            report["is_builtin_timeout"] = isinstance(error, TimeoutError)
            report["message"] = str(error)
            report["peers"] = dict(error.peers)
            report["refusals"] = _refusals(gang, error)
        # Keep the peer stopped for the whole 3T, as the scenario says.
        await anyio.sleep(max(0.0, stopped_at + B3_STOPPED_FOR - time.monotonic()))
    finally:
        os.kill(pids[1], signal.SIGCONT)
    report["stopped_for"] = time.monotonic() - stopped_at
    return report


def test_b3_stopped_peer_times_out_and_breaks_the_gang() -> None:
    """At T (1 s) the op fails with a timeout naming op, seq and T, within T+eps (2.1 s;
    ~1.3 s is typical: the stopped peer's answer is awaited for 0.3 s), and naming the
    stopped rank as the one that gave no answer; the gang breaks and refuses later ops
    at once.

    The stopped rank resumes after 3T and reports, and both ranks exit cleanly
    (``run_world`` fails a rank that exits with a non-zero code). On trio, where agang's
    timer thread drives deadlines; the loop-timer driver of asyncio and uvloop times out
    in B5 (uvloop) and B8 (asyncio). One backend per row keeps this file near 90 s.
    """
    reports = run_world(_stopped_peer, 2, async_backend="trio", op_timeout=B3_TIMEOUT)
    # The resumed rank's report is not checked: its op may end either way (its deadline
    # passed while it was stopped, but Gloo usually finishes the op first, rank 0's side
    # still pending there). That it reported at all, and that both ranks exited with
    # code 0, is what run_world has already checked.
    report = reports[0]

    assert report["context"] == ("all_reduce", 1, B3_TIMEOUT)
    assert B3_TIMEOUT <= report["elapsed"] < B3_TIMEOUT + eps(B3_TIMEOUT)
    assert report["is_builtin_timeout"]
    assert "`all_reduce` (seq 1)" in report["message"]
    assert "rank 1 (" in report["message"]  # named with its host, address and pid
    assert report["peers"] == {1: "no answer (dead, stopped, or cut off from the store)"}
    _assert_refused_at_once(report["refusals"])
    assert report["stopped_for"] >= B3_STOPPED_FOR
    assert all(_process_is_reaped(pid) for pid in report["pids"])


# B4 and B5 share one world: the straggler rounds first, then the short deadline that
# breaks the gang. The gang's default deadline is 30 s; each op names its own.

B4_TIMEOUT = 2.0
B5_DEFAULT = 30.0
B5_TIMEOUT = 0.5


async def _straggler_then_short_deadline(gang: agang.Gang) -> dict[str, Any]:
    """B4: each rank in turn joins an all_reduce 0.5T late. B5: rank 1 stalls and
    rank 0's op asks for 0.5 s under the 30 s default."""
    waited = []
    for late_rank in (1, 0):
        if gang.rank == late_rank:
            await anyio.sleep(0.5 * B4_TIMEOUT)
        started = time.monotonic()
        result = await gang.all_reduce(torch.ones(4), timeout=B4_TIMEOUT)
        waited.append(time.monotonic() - started)
        assert result.tolist() == [2.0] * 4
    stats = gang.statistics()
    straggler = {"waited": waited, "timed_out": stats.num_timed_out, "failed": stats.num_failed}

    short: dict[str, Any] = {"elapsed": None}
    if gang.rank == 1:
        await anyio.sleep(B5_TIMEOUT + eps(B5_TIMEOUT) + 0.5)  # stalls past rank 0's bound
    else:
        started = time.monotonic()
        try:
            await gang.all_reduce(torch.ones(4), timeout=B5_TIMEOUT)
        except agang.GangTimeoutError as error:
            short = {"elapsed": time.monotonic() - started, "timeout": error.context.timeout}
    assert isinstance(gang, agang.ProcessGroupGang)
    return {"straggler": straggler, "short": short, "default": gang.policy.op_timeout}


@pytest.fixture(scope="module")
def straggler_reports() -> list[dict[str, Any]]:
    return run_world(
        _straggler_then_short_deadline, 2, async_backend="uvloop", op_timeout=B5_DEFAULT
    )


def test_b4_straggler_at_half_the_deadline_succeeds(
    straggler_reports: list[dict[str, Any]],
) -> None:
    """A peer 0.5T late is waited for: no false timeout, and the gang stays usable.

    The punctual rank's wait (~1 s) must sit well inside T (2 s): over 0.4T shows it
    really waited for the peer, under T that no deadline fired early.
    """
    for rank, report in enumerate(straggler_reports):
        straggler = report["straggler"]
        punctual_wait = straggler["waited"][rank]  # round 0: rank 1 is late; round 1: rank 0
        assert 0.4 * B4_TIMEOUT < punctual_wait < B4_TIMEOUT
        assert straggler["timed_out"] == 0
        assert straggler["failed"] == 0


def test_b5_op_timeout_shorter_than_the_default_fires_on_time(
    straggler_reports: list[dict[str, Any]],
) -> None:
    """The op's own 0.5 s deadline fires at 0.5 s + eps (1.05 s), not at the 30 s default.

    The other half of B5 (an op timeout longer than the default is honoured) is
    tests/gloo/test_gloo_faults.py::test_op_timeout_longer_than_the_default_is_honoured.
    """
    report = straggler_reports[0]

    assert report["default"] == B5_DEFAULT
    assert report["short"]["elapsed"] is not None, "the op succeeded with its peer stalled"
    assert B5_TIMEOUT <= report["short"]["elapsed"] < B5_TIMEOUT + eps(B5_TIMEOUT)
    assert report["short"]["timeout"] == B5_TIMEOUT


# B7: close the gang while ops are in flight.

# How long rank 1 waits, at most, for rank 0 to be gone (or to kill it).
B7_PEER_WAITS_AT_MOST = 20.0


async def _close_with_ops_in_flight(gang: agang.Gang) -> dict[str, Any]:
    """Rank 0 closes with ops pending that its peer never joins.

    Rank 0 has four all_reduces in flight, rank 1 two recvs; each op has a task waiting
    on it. Rank 1 stays alive, its gang open, until rank 0 has exited, so rank 0 closes,
    and exits, with a live but silent peer (the case a hung peer makes); rank 1 closes
    only then. Rank 1 is no close subject: rank 0's close drops their connections, which
    breaks rank 1's gang first (when both ranks closed at once, one's close broke the
    other's gang now and then, under load).
    """
    pids: list[int] = await gang.all_gather_objects(os.getpid())
    if gang.rank == 0:
        handles = [gang.all_reduce(torch.ones(SMALL_NUMEL)) for _ in range(4)]
    else:
        handles = [gang.recv(torch.empty(SMALL_NUMEL), 0) for _ in range(2)]
    woken: dict[int, float] = {}
    ended_by: dict[int, str] = {}
    other_errors: list[str] = []
    closing_at = math.inf

    async def wait_for(index: int, handle: agang.Handle[torch.Tensor]) -> None:
        try:
            await handle
        except agang.GangClosedError:
            woken[index] = time.monotonic() - closing_at
            ended_by[index] = "GangClosedError"
        except agang.GangBrokenError:
            ended_by[index] = "GangBrokenError"
        except agang.CollectiveError:
            ended_by[index] = "CollectiveError"
        except BaseException as error:  # reported, not swallowed: the test fails on it
            other_errors.append(repr(error))

    async with anyio.create_task_group() as group:
        for index, handle in enumerate(handles):
            group.start_soon(wait_for, index, handle)
        if gang.rank == 0:
            await anyio.sleep(0.3)
        else:
            with anyio.move_on_after(B7_PEER_WAITS_AT_MOST):
                # Polling /proc: rank 0 is not this process's child: nothing to await.
                while not _process_is_gone(pids[0]):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        closing_at = time.monotonic()
        await gang.close()
        close_took = time.monotonic() - closing_at
    try:
        _ = gang.barrier()  # expected to raise: the gang is closed
        refused_after_close = False
    except agang.GangClosedError:
        refused_after_close = True
    return {
        "ended_by": ended_by,
        "num_pending": len(handles),
        "woken": woken,
        "other_errors": other_errors,
        "close_took": close_took,
        "refused_after_close": refused_after_close,
        "pids": pids,
    }


@pytest.fixture(scope="module")
def close_world() -> list[dict[str, Any]]:
    """Both ranks' reports; ``run_world`` raises if a rank failed or exited non-zero."""
    return run_world(_close_with_ops_in_flight, 2, async_backend="trio", timeout=60.0)


def test_b7_close_wakes_pending_waiters_at_once_and_exits_cleanly(
    close_world: list[dict[str, Any]],
) -> None:
    """Every waiter pending on rank 0 gets ``GangClosedError`` within 100 ms of ``close``
    (about 1 ms is typical), later calls are refused, and both ranks exit with code 0 (the
    fixture's ``run_world`` checks the codes): rank 1 exits after its peer is gone, which
    aborted it at exit ("terminate called") while Gloo still ran the abandoned work.
    Rank 1's waiters end too: its gang broke when rank 0's close dropped the connections
    (its first recv fails with that cause, the other with ``GangBrokenError``), or, had
    that not been noticed yet, its own close ended them."""
    closer, peer = close_world
    assert closer["other_errors"] == []
    assert sorted(closer["woken"]) == list(range(closer["num_pending"]))
    assert max(closer["woken"].values()) < 0.1
    assert peer["other_errors"] == []
    assert sorted(peer["ended_by"]) == list(range(peer["num_pending"]))
    assert set(peer["ended_by"].values()) <= {
        "CollectiveError",  # the recv that saw the connection drop
        "GangBrokenError",  # the others, failed as the gang broke
        "GangClosedError",
    }
    assert closer["refused_after_close"]
    assert peer["refused_after_close"]
    assert all(_process_is_reaped(pid) for pid in closer["pids"])


def test_b7_close_returns_within_a_second(close_world: list[dict[str, Any]]) -> None:
    """``close`` returns within 1 s (the promised bound) on both ranks, although rank 0's
    peer stays alive and silent until rank 0 has exited. Tens of ms are expected: close
    aborts the Gloo group (``agang._backends.c10d.abort``), whose destructor otherwise
    waited for the running work until the peer's connections closed (5 s, close's own bound)."""
    assert [report["close_took"] < 1.0 for report in close_world] == [True, True]


async def _peer_dies_while_closer_exits(gang: agang.Gang) -> float:
    """Rank 0 closes with four all_reduces in flight that rank 1 never joins, and kills
    rank 1 (SIGKILL, by pid) from an atexit handler: the peer's connections drop while
    rank 0 exits, after its close returned."""
    pids: list[int] = await gang.all_gather_objects(os.getpid())
    if gang.rank == 1:
        await anyio.sleep(B7_PEER_WAITS_AT_MOST)  # killed by rank 0 long before
        return 0.0
    handles = [gang.all_reduce(torch.ones(SMALL_NUMEL)) for _ in range(4)]
    closing_at = time.monotonic()
    await gang.close()
    close_took = time.monotonic() - closing_at
    for handle in handles:
        assert isinstance(handle.exception(), agang.GangClosedError)
    # Registered last, so it runs first at exit, before agang's own exit handler.
    atexit.register(os.kill, pids[1], signal.SIGKILL)
    return close_took


def test_b7_closer_exits_cleanly_when_its_peer_dies_meanwhile() -> None:
    """The closing rank closes within 1 s and exits with code 0 although its peer dies
    while it exits; only rank 1, killed without a result, is reported as failed. Before
    close aborted the Gloo group, rank 0 aborted at exit (SIGABRT, "terminate called
    after throwing an instance of gloo::IoException"): Gloo still ran the abandoned work
    when the peer's connections dropped."""
    with pytest.raises(WorldRunError) as raised:
        run_world(_peer_dies_while_closer_exits, 2, async_backend="asyncio", timeout=60.0)
    assert set(raised.value.failures) == {1}, raised.value.failures
    assert raised.value.results[0] < 1.0


# B8: a peer blocks its own event loop for 3T.

B8_TIMEOUT = 1.0
B8_BLOCKED_FOR = 3 * B8_TIMEOUT


async def _peer_blocks_its_loop(gang: agang.Gang) -> dict[str, Any]:
    """Rank 1 blocks its loop thread for 3T while a task of its awaits op #0.

    Op #0 completes (on Gloo's threads) early in the block, so the waiting task resumes
    about 3T late: that is the lag its gang must record. Rank 0 meanwhile issues op #1,
    which rank 1 cannot issue while blocked, and must time out at T.
    """
    if gang.rank == 1:
        handle = gang.all_reduce(torch.ones(4))

        async with anyio.create_task_group() as group:
            group.start_soon(_await, handle)
            await anyio.sleep(0.05)  # the task is now suspended on the handle
            blocked_at = time.monotonic()
            time.sleep(B8_BLOCKED_FOR)  # noqa: ASYNC251 -- blocking the loop is the fault
            blocked_for = time.monotonic() - blocked_at
            finished_while_blocked = handle.done()
        lag = gang.statistics().loop_lag
        return {
            "blocked_for": blocked_for,
            "finished_while_blocked": finished_while_blocked,
            "op_elapsed": handle.elapsed,
            "lag_max": None if lag is None else lag.max,
        }
    await anyio.sleep(0.3)  # rank 1 is blocked by now; its Gloo threads still serve op #0
    await gang.all_reduce(torch.ones(4))
    started = time.monotonic()
    try:
        await gang.all_reduce(torch.ones(4), timeout=B8_TIMEOUT)
    except agang.GangTimeoutError as error:
        return {"elapsed": time.monotonic() - started, "seq": error.context.seq}
    return {"elapsed": None}


async def _await(handle: agang.Handle[Any]) -> None:
    await handle


def test_b8_peer_blocking_its_loop() -> None:
    """The punctual rank times out at T (1 s) + eps; the blocked rank's statistics show
    a loop lag of at least 2T (about 2.7 s expected: 3T less the 0.3 s before op #0
    completed), where an unblocked loop shows milliseconds."""
    punctual, blocked = run_world(
        _peer_blocks_its_loop, 2, async_backend="asyncio", op_timeout=60.0
    )

    assert punctual["elapsed"] is not None, "the op succeeded while its peer was blocked"
    assert B8_TIMEOUT <= punctual["elapsed"] < B8_TIMEOUT + eps(B8_TIMEOUT)
    assert punctual["seq"] == 1
    assert blocked["blocked_for"] >= B8_BLOCKED_FOR
    assert blocked["finished_while_blocked"]
    assert blocked["op_elapsed"] < blocked["blocked_for"]
    assert blocked["lag_max"] is not None
    assert blocked["lag_max"] >= 2 * B8_TIMEOUT


# G: load and leaks, in one world: 5k ops first (on a process not yet disturbed by
# 64 MiB buffers), then loop lag with 100 / 500 / 1,000 ops in flight, then mixed sizes.

LEAK_WARM_UP = 2_000
# 5k ops after the warm-up: a leak of 210 B an op or more (1 MiB / 5k) crosses the RSS
# bound; each rank prints its growth (pytest -s -k five_thousand_ops_grow).
LEAK_OPS = 5_000
LEAK_BATCH = 100
LAG_IN_FLIGHT = (100, 500, 1000)
LAG_TICK = 0.005
LAG_ISSUE_CHUNK = 10
LAG_PEER_DELAY = 2.0  # what a loop blocked by a wait for the peer would lag, at least
LAG_MAX = 0.5  # a quarter of that, and 10x the worst lag seen unloaded
NUM_BIG = 3


async def _many_small_ops(gang: agang.Gang) -> dict[str, Any]:
    """5k small all_reduces, 100 in flight at a time, after a 2k warm-up."""
    tensors = [torch.ones(SMALL_NUMEL) for _ in range(LEAK_BATCH)]

    async def run(num_ops: int) -> None:
        for _ in range(num_ops // LEAK_BATCH):
            handles = [gang.all_reduce(tensor) for tensor in tensors]
            for handle in handles:
                await handle

    await run(LEAK_WARM_UP)
    before = census()
    started = time.monotonic()
    await run(LEAK_OPS)
    seconds = time.monotonic() - started
    after = census()
    return {"before": before, "after": after, "seconds": seconds}


async def _lag_with_ops_in_flight(gang: agang.Gang, num_ops: int) -> dict[str, Any]:
    """Rank 0 holds ``num_ops`` all_reduces in flight (rank 1 joins ``LAG_PEER_DELAY`` late), each
    awaited by its own task, while a 5 ms ticker on the same loop measures lag."""
    await gang.barrier()
    factor = sum(rank + 1 for rank in range(gang.size))
    tensors = [torch.full((16,), float(i * (gang.rank + 1))) for i in range(num_ops)]
    results: list[float | None] = [None] * num_ops
    lags: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            before = time.monotonic()
            await anyio.sleep(LAG_TICK)
            lags.append(time.monotonic() - before - LAG_TICK)

    async def wait_for(index: int, handle: agang.Handle[torch.Tensor]) -> None:
        results[index] = (await handle)[0].item()

    handles: list[agang.Handle[torch.Tensor]] = []
    async with anyio.create_task_group() as outer:
        outer.start_soon(ticker)
        if gang.rank == 1:
            await anyio.sleep(LAG_PEER_DELAY)
        async with anyio.create_task_group() as waiters:
            for start in range(0, num_ops, LAG_ISSUE_CHUNK):
                for index in range(start, min(start + LAG_ISSUE_CHUNK, num_ops)):
                    handle = gang.all_reduce(tensors[index])
                    handles.append(handle)
                    waiters.start_soon(wait_for, index, handle)
                await anyio.lowlevel.checkpoint()  # issuing in chunks lets the ticker run
            in_flight_after_issue = gang.statistics().num_in_flight
        stop.set()
    first_seq = handles[0].seq
    return {
        "correct": all(
            value is not None and math.isclose(value, i * factor) for i, value in enumerate(results)
        ),
        "seqs_in_call_order": [handle.seq for handle in handles]
        == list(range(first_seq, first_seq + num_ops)),
        "in_flight_after_issue": in_flight_after_issue,
        "lags": lags,
    }


async def _mixed_sizes(gang: agang.Gang) -> list[tuple[str, float, float]]:
    """Four 1 KiB ops, then three (64 MiB, 1 KiB) pairs, all issued before any await.

    Returns (name, issued, finished) in seconds from the first issue, for the second of
    two rounds (the first warms Gloo's 64 MiB buffers up).
    """
    bigs = [torch.ones(BIG_NUMEL) for _ in range(NUM_BIG)]
    timeline: list[tuple[str, float, float]] = []
    for _ in range(2):
        await gang.barrier()
        named = [("before", gang.all_reduce(torch.ones(SMALL_NUMEL))) for _ in range(4)]
        for i, big in enumerate(bigs):
            named.append((f"big{i}", gang.all_reduce(big)))
            named.append((f"small{i}", gang.all_reduce(torch.ones(SMALL_NUMEL))))
        for _, handle in named:
            await handle
        origin = named[0][1].issued_at
        timeline = [
            (name, handle.issued_at - origin, handle.issued_at + (handle.elapsed or 0) - origin)
            for name, handle in named
        ]
    return timeline


async def _load_and_leaks(gang: agang.Gang) -> dict[str, Any]:
    # A full collection of this process's heap (torch's modules, mostly) takes ~90 ms
    # here whatever agang does, and the garbage of 1,000 awaiting tasks sets one off; a
    # latency-minded service freezes its start-up heap, and so does this program, so the
    # ticker measures agang's lag rather than the size of torch.
    gc.collect()
    gc.freeze()
    return {
        "leak": await _many_small_ops(gang),
        "lag": {num_ops: await _lag_with_ops_in_flight(gang, num_ops) for num_ops in LAG_IN_FLIGHT},
        "mixed": await _mixed_sizes(gang),
    }


@pytest.fixture(scope="module")
def load_reports() -> list[dict[str, Any]]:
    return run_world(_load_and_leaks, 2, async_backend="asyncio", timeout=110.0)


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98]


def test_g_loop_lag_with_ops_in_flight(load_reports: list[dict[str, Any]]) -> None:
    """With 100, 500 and 1,000 ops in flight, each awaited by its own task: every result
    is right, seqs follow call order, and a 5 ms ticker's lag stays "OK" on both ranks:
    max < ``LAG_MAX`` (0.5 s) at each level, and p99 < 50 ms over the whole run (~900 ticks).

    The failure this guards against is a loop that waits for the peer: rank 1 joins
    ``LAG_PEER_DELAY`` (2 s) late, so such a loop lags 2 s or more on rank 0. What a
    healthy loop lags comes from the ranks' Gloo threads taking the GIL and from
    awaiters woken in bursts. With Gloo's default order checks (one side-group gather
    per op, whose callback starts the op on a Gloo thread), the rank whose ops complete
    as it issues them lags most: ``pytest -n0 -s tests/gloo/test_runtime_faults.py -k
    loop_lag`` prints each rank's p99 and max (2026-11-28, 2-core machine, three runs:
    max 18-29 ms, p99 6-10 ms there; 7-11 ms and 3-4 ms on the other rank); CI has seen
    a 115 ms max (before the check was issued on the side group directly), and a run
    beside busy loops 132 ms, so the bound is 0.5 s, 10x the worst max seen here
    unloaded and a quarter of the failure's. The p99 is taken over the run,
    not per level, because a level has only 100-300 ticks, so its p99 is its second or
    third worst tick. Issuing costs ~0.1 ms of loop time per op, so ops are issued ten
    per loop turn, as a service would pace a burst. 1,000 awaiters on uvloop and trio:
    tests/gloo/test_gloo_faults.py::test_a_thousand_ops_in_flight_complete_correctly.
    """
    for rank, report in enumerate(load_reports):
        levels = report["lag"]
        for num_ops, level in levels.items():
            summary = (rank, num_ops, _p99(level["lags"]), max(level["lags"]))
            assert level["correct"], summary
            assert level["seqs_in_call_order"], summary
            assert len(level["lags"]) > 20, summary
            assert max(level["lags"]) < LAG_MAX, summary
        every_tick = [lag for level in levels.values() for lag in level["lags"]]
        worst = max(every_tick)
        print(f"rank {rank}: lag p99 {_p99(every_tick) * 1e3:.0f} ms, max {worst * 1e3:.0f} ms")
        assert _p99(every_tick) < 0.050, (rank, _p99(every_tick))
    for num_ops, level in load_reports[0]["lag"].items():
        # Rank 1 joins 2 s late: rank 0 really held (nearly) all of them in flight.
        in_flight = level["in_flight_after_issue"]
        assert in_flight >= 0.9 * num_ops, (num_ops, in_flight)


def test_g_small_ops_are_not_starved_by_big_ones(load_reports: list[dict[str, Any]]) -> None:
    """FIFO, not starvation: a 1 KiB op issued right after a 64 MiB one finishes no later
    than a quarter of a big op's time after it (same-time or earlier is typical) and
    before the next big one; 1 KiB ops issued first finish within half a big op's time
    (a few ms is typical, against ~100 ms for a 64 MiB all_reduce here)."""
    for rank, report in enumerate(load_reports):
        timeline = {name: (issued, finished) for name, issued, finished in report["mixed"]}
        befores = [(i, f) for name, i, f in report["mixed"] if name == "before"]
        big_seconds = [timeline[f"big{i}"][1] - timeline[f"big{i}"][0] for i in range(NUM_BIG)]
        slack = 0.25 * statistics.median(big_seconds)
        for issued, finished in befores:
            assert finished - issued < 0.5 * big_seconds[0], (rank, report["mixed"])
        for i in range(NUM_BIG):
            small_finished = timeline[f"small{i}"][1]
            assert small_finished <= timeline[f"big{i}"][1] + slack, (rank, report["mixed"])
            if i + 1 < NUM_BIG:
                assert small_finished < timeline[f"big{i + 1}"][1], (rank, report["mixed"])


def test_g_five_thousand_ops_leave_threads_and_fds_flat(
    load_reports: list[dict[str, Any]],
) -> None:
    """After a 2k warm-up, 5k more ops start no thread (Python or native) and leave no
    fd open: the counts are equal, not merely close."""
    for report in load_reports:
        before, after = report["leak"]["before"], report["leak"]["after"]
        for key in ("threads", "native_threads", "fds"):
            assert after[key] == before[key], (key, before, after)


def test_g_five_thousand_ops_grow_rss_under_1_mib(load_reports: list[dict[str, Any]]) -> None:
    """RSS growth over 5k ops after a 2k warm-up (gc collected before each reading)
    stays under 1 MiB: a leak of 210 B an op or more crosses it. Each rank's growth is
    printed, for the margin (``-s``)."""
    for rank, report in enumerate(load_reports):
        growth = report["leak"]["after"]["rss_kib"] - report["leak"]["before"]["rss_kib"]
        print(f"rank {rank}: RSS grew {growth} KiB over {LEAK_OPS} ops")
        assert growth < 1024, report["leak"]
