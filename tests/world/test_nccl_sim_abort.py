"""Aborting NCCL on a rank whose own device is busy, on ``agang.testing.SimulatedNccl``.

NCCL's ``abort()`` returns only once this rank's device has reached the communicator's
queued kernels (an all-reduce queued behind 1.8 s of the rank's own kernel made it take
1.46 s on an H100); a peer that never comes does not make it wait. The simulation keeps
that rule, and these tests hold agang's deadline and close paths to it: the deadline
still fires on time without blocking the event loop, and close returns once the device
got past the stall, or gives up at its bound. Timing bounds leave 10x margins between a
pass and a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import anyio
import pytest
import torch

import agang
from agang._cli.selfcheck.checks import max_loop_lag
from agang._collective import gang as _collective_gang
from agang.testing import SimulatedNccl

pytestmark = pytest.mark.anyio

BOUND = 30.0  # seconds: no test may hang longer
STALL = 3.0  # seconds of a rank's own device work; passes take a tenth of it or less


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedNccl]:
    simulation = SimulatedNccl(2, watchdog_timeout=20.0)
    yield simulation
    simulation.close()


@pytest.mark.slow  # waits out a device stall of STALL (3 s)
async def test_abort_waits_for_the_ranks_own_stall_but_not_for_a_late_peer(
    sim: SimulatedNccl,
) -> None:
    """On the raw groups: rank 1's all-reduce is queued behind its own stall, so rank 0's
    waits for a late peer. Rank 0's abort returns at once; rank 1's returns only once its
    device got past the stall, and its kernel then exits without writing."""
    gangs = sim.gangs()
    groups = [g.process_group for g in gangs]
    stall = sim.stall(1, STALL)
    tensors = [torch.full((2,), float(rank + 1)) for rank in range(2)]
    works = [group.allreduce([t]) for group, t in zip(groups, tensors, strict=True)]

    started = time.monotonic()
    await anyio.to_thread.run_sync(groups[0].abort)
    assert time.monotonic() - started < STALL / 6  # the late peer is not waited for
    assert works[0].is_completed()
    assert works[0].exception() is not None

    await anyio.to_thread.run_sync(groups[1].abort)
    ended = stall.wait(0)
    assert ended is not None, "abort returned before the device got past the stall"
    assert works[1].is_completed()
    assert works[1].exception() is not None
    assert [t.tolist() for t in tensors] == [[1.0, 1.0], [2.0, 2.0]]  # nothing written
    await gangs[0].close()
    await gangs[1].close()


async def test_a_stall_counts_from_when_the_device_starts_it(sim: SimulatedNccl) -> None:
    release = sim.hold(0)
    stall = sim.stall(0, 0.2)
    await anyio.sleep(0.3)
    released_at = time.monotonic()
    release()
    ended = await anyio.to_thread.run_sync(stall.wait, BOUND)
    assert ended is not None
    assert ended >= released_at + 0.2
    with pytest.raises(ValueError, match="`seconds`"):
        sim.stall(0, -1.0)


@pytest.mark.slow  # waits out a device stall of STALL (3 s)
async def test_a_deadline_behind_the_ranks_own_stall_fires_on_time_and_close_waits_for_it(
    sim: SimulatedNccl,
) -> None:
    """(a) An op past its deadline fails on time on both ranks, the stalled one included,
    and the loop never blocks, though the abort that follows waits for the stall on a
    thread of its own. (b) Close of the stalled rank returns once its device got past the
    stall (the abort it waits for cannot end sooner), and the loop keeps running."""
    gangs = sim.gangs()
    deadline = 0.1
    stall = sim.stall(1, STALL)
    with anyio.fail_after(BOUND):
        started = time.monotonic()

        async def expect_timeouts() -> list[float]:
            failed_after = []
            for handle in [g.all_reduce(torch.ones(2), timeout=deadline) for g in gangs]:
                with pytest.raises(agang.GangTimeoutError):
                    await handle
                failed_after.append(time.monotonic() - started)
            return failed_after

        lag, failed_after = await max_loop_lag(expect_timeouts)
        assert max(failed_after) < STALL / 3  # ~0.1 s, where waiting for the stall is 3 s
        assert stall.wait(0) is None  # the device is still in the stall
        assert lag < STALL / 6

        async def close_both() -> float:
            await gangs[0].close()
            await gangs[1].close()
            return time.monotonic()

        lag, closed = await max_loop_lag(close_both)
        ended = stall.wait(0)
        assert ended is not None, "close returned before the stalled device got past it"
        assert closed - ended < STALL / 3  # waiting out the 5 s bound: 2 s after
        assert lag < STALL / 6


@pytest.mark.slow  # waits out a device stall of STALL (3 s)
async def test_close_behind_a_stall_longer_than_its_bound_returns_at_the_bound(
    sim: SimulatedNccl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(b) A stall longer than close's bound (5 s; 0.1 s here): close returns at the
    bound with the gang closed and its op failed; the release goes on on its own thread
    and ends (aborted communicator, group dropped) once the device got past the stall."""
    monkeypatch.setattr(_collective_gang, "_CLOSE_SECONDS", 0.1)
    gangs = sim.gangs("long-stall")

    def closing_threads() -> list[str]:
        names = [t.name for t in threading.enumerate()]
        return [n for n in names if n.startswith("agang: close gang 'long-stall'")]

    stall = sim.stall(1, STALL)
    with anyio.fail_after(BOUND):
        handle = gangs[1].all_reduce(torch.ones(2))
        await gangs[0].close()  # rank 0's op is never issued; its close is quick
        started = time.monotonic()
        await gangs[1].close()
        assert time.monotonic() - started < STALL / 6  # at the bound, not the stall's end
        assert gangs[1].closed
        assert stall.wait(0) is None
        with pytest.raises(agang.GangError):
            await handle
        for _ in range(int(BOUND / 0.02)):  # the release thread goes on past the close
            if not closing_threads():
                break
            await anyio.sleep(0.02)
        assert not closing_threads()
        assert stall.wait(0) is not None  # it ended only after the device got past
