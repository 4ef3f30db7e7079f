"""Real Gloo ranks on loopback: late peers, missed deadlines, lost peers, cancellation.

Each program runs on every rank of a fresh world (agang.testing.run_world) and returns
plain data; the assertions run in the test. Bounds on time keep a 10x margin between the
passing and the failing behaviour.
"""

from __future__ import annotations

import gc
import math
import threading
import time
from typing import Any

import anyio
import pytest
import torch
from netutil import rank_env

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo

ASYNC_BACKENDS = ["asyncio", "uvloop", "trio"]
LATE = 3.0


async def _late_peer(gang: agang.Gang) -> dict[str, Any]:
    """Rank 1 joins an all_reduce ``LATE`` s late; rank 0's loop keeps ticking meanwhile.

    A loop blocked by the wait would lag ``LATE``; the bound is a tenth of that. The heap
    is frozen first, as a latency-minded service does: a full collection of torch's
    modules takes ~90 ms here, whatever agang does (test_runtime_faults.py's load test),
    and without the freeze, beside two busy loops, this test once saw a 0.51 s lag.
    """
    gc.collect()
    gc.freeze()
    if gang.rank == 1:
        await anyio.sleep(LATE)
        await gang.all_reduce(torch.ones(3))
        return {}
    lags: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.monotonic()
            await anyio.sleep(0.005)
            lags.append(time.monotonic() - before - 0.005)

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        started = time.monotonic()
        result = await gang.all_reduce(torch.ones(3))
        waited = time.monotonic() - started
        done.set()
    return {"result": result.tolist(), "waited": waited, "max_lag": max(lags), "ticks": len(lags)}


@pytest.mark.parametrize("async_backend", ASYNC_BACKENDS)
def test_loop_keeps_running_while_a_peer_is_late(async_backend: str) -> None:
    report = run_world(_late_peer, 2, async_backend=async_backend)[0]

    assert report["result"] == [2.0, 2.0, 2.0]
    assert report["waited"] > LATE * 0.75  # it really waited for the peer
    assert report["max_lag"] < LATE / 10  # and the loop was never blocked meanwhile
    assert report["ticks"] > 50


async def _missed_deadline(gang: agang.Gang) -> dict[str, Any]:
    """Rank 1 never joins; rank 0's op has a 1 s deadline (the gang's default is 60 s)."""
    if gang.rank == 1:
        await anyio.sleep(4.0)
        return {}
    started = time.monotonic()
    try:
        await gang.all_reduce(torch.ones(2), timeout=1.0)
    except agang.GangTimeoutError as error:
        timeout_report = {
            "elapsed": time.monotonic() - started,
            "is_builtin_timeout": isinstance(error, TimeoutError),
            "op": error.context.op,
            "seq": error.context.seq,
            "timeout": error.context.timeout,
            "message": str(error),
        }
    before = time.monotonic()
    try:
        gang.barrier()
    except agang.GangBrokenError as error:
        broken_report = {
            "refused_in": time.monotonic() - before,
            "cause_is_timeout": isinstance(error.__cause__, agang.GangTimeoutError),
        }
    return {"timeout": timeout_report, "broken": broken_report}


def test_missed_deadline_times_out_and_breaks_the_gang() -> None:
    report = run_world(_missed_deadline, 2, op_timeout=60.0)[0]

    timeout = report["timeout"]
    assert 0.9 < timeout["elapsed"] < 10.0
    assert timeout["is_builtin_timeout"]
    assert (timeout["op"], timeout["seq"], timeout["timeout"]) == ("all_reduce", 0, 1.0)
    assert "all_reduce" in timeout["message"]
    assert "rank 0 of 2" in timeout["message"]
    assert report["broken"]["cause_is_timeout"]
    assert report["broken"]["refused_in"] < 0.5


async def _longer_than_default(gang: agang.Gang) -> float:
    """An op may ask for a deadline longer than the gang's default (1 s here)."""
    if gang.rank == 1:
        await anyio.sleep(LATE)
    started = time.monotonic()
    await gang.all_reduce(torch.ones(1), timeout=30.0)
    return time.monotonic() - started


def test_op_timeout_longer_than_the_default_is_honoured() -> None:
    waited = run_world(_longer_than_default, 2, op_timeout=1.0)[0]

    assert waited > LATE * 0.75


async def _peer_exits(gang: agang.Gang) -> dict[str, Any]:
    """Rank 1 leaves without joining; rank 0 learns of it through an error, not a hang."""
    if gang.rank == 1:
        import os

        os._exit(0)
    started = time.monotonic()
    try:
        await gang.all_reduce(torch.ones(1024), timeout=20.0)
    except agang.GangError as error:
        return {"error": type(error).__name__, "elapsed": time.monotonic() - started}
    return {"error": None}


def test_a_lost_peer_fails_the_op_instead_of_hanging() -> None:
    with pytest.raises(agang.testing.WorldRunError) as raised:
        run_world(_peer_exits, 2)
    report = raised.value.results[0]

    # Rank 1 gave no result (it exited); rank 0 saw a GangError before its deadline.
    assert set(raised.value.failures) == {1}
    assert report["error"] in ("CollectiveError", "GangTimeoutError")
    assert report["elapsed"] < 20.0 + 5.0


async def _cancelled_waiter(gang: agang.Gang) -> dict[str, Any]:
    """Rank 0 stops waiting; the op goes on and its tensor stays busy until it ends."""
    tensor = torch.full((8,), float(gang.rank + 1))
    if gang.rank == 1:
        await anyio.sleep(1.5)
        await gang.all_reduce(tensor)
        return {}
    handle = gang.all_reduce(tensor)
    with anyio.move_on_after(0.2) as scope:
        await handle
    refused = []
    for name, candidate in (("tensor", tensor), ("view", tensor[2:4])):
        try:
            gang.all_reduce(candidate)
        except agang.TensorBusyError as error:
            refused.append((name, "`tensor`" in str(error)))
    was_done_after_cancel = handle.done()
    result = await handle
    return {
        "cancelled": scope.cancelled_caught,
        "was_done_after_cancel": was_done_after_cancel,
        "refused": refused,
        "result": result.tolist(),
        "same_tensor": result is tensor,
    }


@pytest.mark.parametrize("async_backend", ["asyncio", "trio"])
def test_cancelled_waiter_leaves_the_op_running(async_backend: str) -> None:
    report = run_world(_cancelled_waiter, 2, async_backend=async_backend)[0]

    assert report["cancelled"]
    assert not report["was_done_after_cancel"]
    assert report["refused"] == [("tensor", True), ("view", True)]
    assert report["result"] == [3.0] * 8
    assert report["same_tensor"]


async def _waits_from_threads(gang: agang.Gang) -> dict[str, Any]:
    """Handles waited from plain threads, and ops issued and waited off the loop."""
    tensors = [torch.full((4,), float(gang.rank + i)) for i in range(8)]
    handles = [gang.all_reduce(t) for t in tensors]
    results: list[list[float]] = [[] for _ in handles]

    def wait_one(index: int) -> None:
        results[index] = handles[index].wait(timeout=30.0).tolist()

    threads = [threading.Thread(target=wait_one, args=(i,)) for i in range(len(handles))]
    for thread in threads:
        thread.start()
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, 30.0)
    issued_off_loop = await anyio.to_thread.run_sync(
        lambda: gang.all_reduce(torch.ones(2)).wait(timeout=30.0).tolist()
    )
    return {"results": results, "issued_off_loop": issued_off_loop}


def test_wait_from_plain_threads() -> None:
    report = run_world(_waits_from_threads, 2)[0]

    assert report["results"] == [[float(2 * i + 1)] * 4 for i in range(8)]
    assert report["issued_off_loop"] == [2.0, 2.0]


async def _many_in_flight(gang: agang.Gang) -> dict[str, Any]:
    """1,000 all_reduces issued before any is awaited, then awaited together."""
    count = 1000
    tensors = [torch.full((16,), float(i * (gang.rank + 1))) for i in range(count)]
    handles = [gang.all_reduce(t) for t in tensors]
    results: list[Any] = [None] * count

    async def wait_one(i: int) -> None:
        results[i] = (await handles[i])[0].item()

    async with anyio.create_task_group() as group:
        for i in range(count):
            group.start_soon(wait_one, i)
    factor = sum(r + 1 for r in range(gang.size))
    return {
        "correct": all(math.isclose(results[i], i * factor) for i in range(count)),
        "seqs": [h.seq for h in handles] == list(range(count)),
        "in_flight_after": gang.statistics().num_in_flight,
    }


@pytest.mark.parametrize("async_backend", ["uvloop", "trio"])
def test_a_thousand_ops_in_flight_complete_correctly(async_backend: str) -> None:
    for report in run_world(_many_in_flight, 2, async_backend=async_backend):
        assert report == {"correct": True, "seqs": True, "in_flight_after": 0}


CLOSE_PEER_STAYS = 5.0
CLOSE_WAKES_WITHIN = 0.5


async def _close_with_op_in_flight(gang: agang.Gang) -> dict[str, Any]:
    """Rank 0 closes its gang while an op that rank 1 never joins is pending.

    Rank 1 stays ``CLOSE_PEER_STAYS`` seconds: a waiter that only its exit woke (its
    connections closing) would wake that late, 10x the bound on a close's wake-up.
    """
    if gang.rank == 1:
        await anyio.sleep(CLOSE_PEER_STAYS)
        return {}
    handle = gang.all_reduce(torch.ones(4))
    outcome: dict[str, Any] = {}

    async def waiter() -> None:
        try:
            await handle
        except agang.GangClosedError:
            outcome["woken_after"] = time.monotonic() - closing_at

    async with anyio.create_task_group() as group:
        group.start_soon(waiter)
        await anyio.sleep(0.1)
        closing_at = time.monotonic()
        await gang.close()
        outcome["close_took"] = time.monotonic() - closing_at
    try:
        gang.barrier()
    except agang.GangClosedError:
        outcome["refused_after_close"] = True
    return outcome


def test_close_with_an_op_in_flight_wakes_waiters_and_exits_cleanly() -> None:
    # run_world also fails a rank that crashes on its way out after returning.
    report = run_world(_close_with_op_in_flight, 2)[0]

    assert report["woken_after"] < CLOSE_WAKES_WITHIN
    assert report["close_took"] < CLOSE_WAKES_WITHIN
    assert report["refused_after_close"]


def _world_gang_of_two(rank: int, port: int) -> agang.Gang:
    """This spawned process's root gang, rank ``rank`` of 2, on the test's store."""
    env = rank_env(rank, port, agent_store=True)
    return agang.init_sync(env=env, in_process=False, timeout=60, op_timeout=60)


def _exit_codes_of_two_ranks(target: Any) -> list[int | None]:
    """Runs ``target(rank, port)`` in two spawned processes on a store hosted here."""
    import multiprocessing
    from datetime import timedelta

    import torch.distributed as dist

    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    ranks = [context.Process(target=target, args=(r, store.port)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()
    return [process.exitcode for process in ranks]


def _rank_that_never_closes(rank: int, port: int) -> None:
    gang = _world_gang_of_two(rank, port)
    for _ in range(100):
        gang.all_reduce(torch.ones(4)).wait(timeout=60)


def test_processes_that_never_close_their_gang_exit_cleanly() -> None:
    # Raw c10d sometimes aborts at exit here (1 run in 6 seen); agang closes at exit.
    exit_codes = []
    for _ in range(3):
        exit_codes += _exit_codes_of_two_ranks(_rank_that_never_closes)
    assert exit_codes == [0] * 6


def _rank_that_drops_its_gang(rank: int, port: int) -> None:
    import gc
    import sys
    import weakref

    gang = _world_gang_of_two(rank, port)
    gang.all_reduce(torch.ones(4)).wait(timeout=60)
    kept = weakref.ref(gang)
    del gang
    gc.collect()
    if kept() is None:  # gone: nothing would close its group at exit
        sys.exit(3)


def test_a_world_gang_dropped_unclosed_is_kept_for_the_exit_closer() -> None:
    """c10d keeps the world group registered after the program drops its gang; agang
    keeps the gang too, so that exit closes the group (a group alive at exit can abort
    the process, as in the test above). Exit code 3: the gang was gone."""
    assert _exit_codes_of_two_ranks(_rank_that_drops_its_gang) == [0, 0]
