"""Waking a waiter, and ``wait_mode="block_briefly"`` (``agang._runtime.brief_wait``).

The rules of the brief block are tested on plain futures with the window made long
(seconds) or tiny, so that no test depends on how fast this machine is; what it changes
for users (nothing but timing) is tested through gangs: FakeWorld (whose ops finish on
the loop, so a block never catches one and every await falls back to parking) and real
Gloo ranks (whose ops finish on Gloo's thread, so blocks do catch them).
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

import anyio
import pytest
import torch

import agang
from agang._policy import WAIT_MODE_ENV, make_policy
from agang._runtime import brief_wait
from agang._runtime.future import Future, num_parked
from agang.testing import FakeWorld, run_world

pytestmark = pytest.mark.anyio

# Windows "long enough": a thread finishing a future within one is never in doubt.
LONG = 30.0


@pytest.fixture(autouse=True)
def fresh_estimates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no recent op times and no back-off."""
    for name in ("_estimates", "_recent", "_num_missed", "_num_to_skip"):
        monkeypatch.setattr(brief_wait, name, {})


def _long_windows(monkeypatch: pytest.MonkeyPatch, num_bytes: int = 4) -> None:
    monkeypatch.setattr(brief_wait, "BRIEF_MAX_SECONDS", LONG)
    brief_wait.record(num_bytes, LONG / 2)


def _finish_soon(future: Future[Any], value: Any) -> threading.Thread:
    thread = threading.Timer(0.01, future._finish, (value, None))
    thread.start()
    return thread


async def test_a_block_returns_once_another_thread_finishes_the_future(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: tuple[str, dict[str, bool]]
) -> None:
    if anyio_backend[1].get("use_uvloop"):
        pytest.skip("uvloop is never blocked (rule 2)")
    _long_windows(monkeypatch)
    future: Future[int] = Future("op")
    thread = _finish_soon(future, 7)
    assert brief_wait.block_briefly(future, 4, issued_at=_now())
    assert future.done()
    assert future._callbacks == []
    assert await future == 7
    thread.join()


async def test_a_block_that_ends_unfinished_leaves_no_callback_and_backs_off(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: tuple[str, dict[str, bool]]
) -> None:
    if anyio_backend[1].get("use_uvloop"):
        pytest.skip("uvloop is never blocked (rule 2)")
    monkeypatch.setattr(brief_wait, "BRIEF_MAX_SECONDS", 0.001)
    brief_wait.record(4, 0.0005)
    future: Future[int] = Future("op")
    key = (4).bit_length()
    assert not brief_wait.block_briefly(future, 4, issued_at=_now())
    assert future._callbacks == []
    assert brief_wait._num_to_skip[key] == 0  # one miss alone changes nothing (rule 3)
    assert not brief_wait.block_briefly(future, 4, issued_at=_now())
    # Two in a row: the next await of that size parks at once, without blocking.
    assert brief_wait._num_to_skip[key] == 1
    assert not brief_wait.block_briefly(future, 4, issued_at=_now())
    assert (brief_wait._num_missed[key], brief_wait._num_to_skip[key]) == (2, 0)
    # Then it blocks again; a third miss in a row skips the next three.
    assert not brief_wait.block_briefly(future, 4, issued_at=_now())
    assert (brief_wait._num_missed[key], brief_wait._num_to_skip[key]) == (3, 3)


@pytest.mark.parametrize(
    ("num_bytes", "why"),
    [(4, "no recent time for this size"), (brief_wait.BRIEF_MAX_BYTES * 2, "too large")],
)
async def test_no_block_without_an_estimate_or_for_large_ops(num_bytes: int, why: str) -> None:
    future: Future[int] = Future("op")
    if why == "too large":
        brief_wait.record(num_bytes, 1e-4)
    assert not brief_wait.block_briefly(future, num_bytes, issued_at=_now()), why


async def test_no_block_for_an_op_slower_than_the_bound() -> None:
    brief_wait.record(4, brief_wait.BRIEF_MAX_SECONDS * 2)
    assert not brief_wait.block_briefly(Future("op"), 4, issued_at=_now())


async def test_the_estimate_is_a_median_so_one_slow_op_changes_nothing() -> None:
    for seconds in [1e-4] * 5 + [10.0]:
        brief_wait.record(4, seconds)
    assert brief_wait._estimates[(4).bit_length()] == 1e-4


async def test_no_block_while_another_waiter_is_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    _long_windows(monkeypatch)
    parked: Future[None] = Future("parked")
    async with anyio.create_task_group() as group:
        group.start_soon(_await, parked)
        await anyio.sleep(0.01)  # it parks
        assert num_parked() == 1
        assert not brief_wait.block_briefly(Future("op"), 4, issued_at=_now())
        parked._finish(None, None)
    assert num_parked() == 0


async def test_no_block_while_the_loop_has_other_ready_work(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: tuple[str, dict[str, bool]]
) -> None:
    name, options = anyio_backend
    _long_windows(monkeypatch)
    ran = anyio.Event()
    if options.get("use_uvloop"):
        # uvloop cannot say whether it has ready work: it is never blocked (rule 2).
        assert not brief_wait.block_briefly(Future("op"), 4, issued_at=_now())
        ran.set()
    elif name == "asyncio":
        asyncio.get_running_loop().call_soon(ran.set)
        assert not brief_wait.block_briefly(Future("op"), 4, issued_at=_now())
    else:
        async with anyio.create_task_group() as group:
            group.start_soon(_set, ran)  # runnable, not yet run
            assert not brief_wait.block_briefly(Future("op"), 4, issued_at=_now())
    await ran.wait()


def test_the_mode_is_checked_and_read_from_the_environment() -> None:
    assert make_policy(op_timeout=math.inf).wait_mode == "park"
    policy = make_policy(op_timeout=math.inf, env={WAIT_MODE_ENV: "block_briefly"})
    assert policy.wait_mode == "block_briefly"
    with pytest.raises(ValueError, match="`wait_mode` must be one of 'park', 'block_briefly'"):
        make_policy(op_timeout=math.inf, wait_mode="spin")
    with pytest.raises(ValueError, match=f"`{WAIT_MODE_ENV}` must be one of"):
        make_policy(op_timeout=math.inf, env={WAIT_MODE_ENV: "fast"})


# Through gangs: the same results, errors, deadlines and cancellation as parking.


@pytest.fixture
def brief(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_MODE_ENV, "block_briefly")


@pytest.mark.usefixtures("brief")
async def test_fake_world_results_are_those_of_parking() -> None:
    world = FakeWorld(2)
    assert world[0].policy.wait_mode == "block_briefly"

    async def sums(gang: agang.Gang) -> list[float]:
        out = []
        for step in range(20):
            tensor = torch.full((4,), float(gang.rank + step))
            out.append((await gang.all_reduce(tensor))[0].item())
        return out

    assert await world.run(sums) == [[float(1 + 2 * step) for step in range(20)]] * 2


@pytest.mark.usefixtures("brief")
async def test_fake_world_deadline_and_cancellation_are_those_of_parking(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: tuple[str, dict[str, bool]]
) -> None:
    world = FakeWorld(2, op_timeout=0.5)
    # Small ops look fast enough to block for up to 20 ms, in vain (the loop finishes
    # FakeWorld's ops): the await blocks, parks, and is cancelled as a parked one is.
    monkeypatch.setattr(brief_wait, "BRIEF_MAX_SECONDS", 0.02)
    brief_wait.record(4, 0.02)
    tensor = torch.zeros(1)
    handle = world[0].all_reduce(tensor)  # rank 1 never joins
    with anyio.move_on_after(0.05):
        await handle
    assert not handle.done()  # the wait was cancelled, not the op
    blocked = not anyio_backend[1].get("use_uvloop")  # uvloop never blocks (rule 2)
    assert brief_wait._num_missed == ({(4).bit_length(): 1} if blocked else {})
    with pytest.raises(agang.TensorBusyError):
        world[0].all_reduce(tensor)
    with pytest.raises(agang.GangTimeoutError):
        await handle


async def _gloo_rows(gang: agang.Gang) -> dict[str, Any]:
    """Small ops that Gloo's thread finishes while the loop blocks, a cancelled wait, a
    failed op and a deadline: what each rank saw."""
    report: dict[str, Any] = {"mode": gang.policy.wait_mode}
    caught: list[bool] = []
    block_briefly = brief_wait.block_briefly

    def counting(future: Future[Any], num_bytes: int, issued_at: float) -> bool:
        caught.append(block_briefly(future, num_bytes, issued_at))
        return caught[-1]

    brief_wait.block_briefly = counting  # this rank's process only
    # A loaded test machine may take more than the 1 ms cap per small op, and then
    # nothing would block: a cap of 50 ms keeps the check on catching, not on speed.
    brief_wait.BRIEF_MAX_SECONDS = 0.05
    sums = []
    for step in range(50):
        tensor = torch.full((4,), float(gang.rank + step))
        sums.append((await gang.all_reduce(tensor))[0].item())
    report["sums"] = sums
    report["estimated"] = bool(brief_wait._estimates)
    report["caught"] = sum(caught)

    # A cancelled wait leaves the op running: rank 1 joins only after rank 0 gave up,
    # told so on a lane of its own (a sleep of rank 1's was outrun by a loaded machine).
    told = await gang.lane("told")
    tensor = torch.ones(1)
    if gang.rank == 1:
        await told.recv(torch.zeros(1), 0)
    handle = gang.all_reduce(tensor)
    with anyio.move_on_after(0.05) as scope:
        await handle
    if gang.rank == 0:
        await told.send(torch.zeros(1), 1)
    report["cancelled"] = scope.cancelled_caught
    report["after_cancel"] = (await handle).item()

    # A deadline, on a lane of its own (it breaks): rank 1 never issues this one.
    lane = await gang.lane("deadline")
    if gang.rank == 0:
        try:
            await lane.all_reduce(torch.ones(1), timeout=0.3)
        except agang.GangTimeoutError as exc:
            report["timeout"] = type(exc).__name__
    await gang.barrier()
    return report


@pytest.mark.gloo
@pytest.mark.parametrize("async_backend", ["asyncio", "uvloop", "trio"])
def test_gloo_results_errors_deadlines_and_cancellation(async_backend: str) -> None:
    reports = run_world(
        _gloo_rows,
        2,
        async_backend=async_backend,
        env={WAIT_MODE_ENV: "block_briefly"},
        timeout=90.0,
    )
    for report in reports:
        assert report["mode"] == "block_briefly"
        assert report["sums"] == [float(1 + 2 * step) for step in range(50)]
        assert report["estimated"]
        # Gloo's thread finishes ops while the loop blocks; uvloop is never blocked.
        assert (report["caught"] > 0) == (async_backend != "uvloop")
        assert report["after_cancel"] == 2.0
    assert reports[0]["cancelled"]
    assert reports[0]["timeout"] == "GangTimeoutError"


async def _await(future: Future[Any]) -> None:
    await future


async def _set(event: anyio.Event) -> None:
    event.set()


def _now() -> float:
    import time

    return time.monotonic()
