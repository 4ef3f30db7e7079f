"""Closing, deadlines, breaking and cancellation on FakeWorld (fault scenarios E* and F*).

A FakeWorld op finishes only once every rank has issued it, so a rank that does not
issue plays a late or lost peer; ``latency`` makes ops take time once they have met.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
from typing import Any

import anyio
import pytest
import torch

import agang
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio

# Generous bounds for "at once" and "soon": ten times what the machine should need.
AT_ONCE = 1.0
PATIENCE = 10.0


async def all_reduce_everywhere(world: FakeWorld, tensors: list[torch.Tensor]) -> None:
    handles = [gang.all_reduce(t) for gang, t in zip(world, tensors, strict=True)]
    for handle in handles:
        await handle


# Closing.


async def test_a_closed_gang_refuses_calls() -> None:
    world = FakeWorld(2)
    await world[0].close()

    assert world[0].closed
    assert not world[1].closed
    with pytest.raises(agang.GangClosedError, match="closed"):
        world[0].all_reduce(torch.ones(1))
    with pytest.raises(agang.GangClosedError):
        world[0].barrier()
    with pytest.raises(agang.GangClosedError):
        await world[0].create_gang([0])


async def test_close_twice_is_harmless() -> None:
    world = FakeWorld(2)

    await world[0].close()
    await world[0].close()
    world[0].close_sync()
    world[1].close_sync()
    world[1].close_sync()
    await world[1].close()

    assert world[0].closed
    assert world[1].closed


async def test_closing_fails_pending_waiters_at_once() -> None:
    world = FakeWorld(3, op_timeout=math.inf)
    tensor = torch.ones(2)
    pending = [world[0].all_reduce(tensor), world[0].barrier()]  # the peers never come
    errors: list[BaseException] = []

    async def wait(handle: agang.Handle[Any]) -> None:
        try:
            await handle
        except agang.GangClosedError as error:
            errors.append(error)

    async with anyio.create_task_group() as group:
        for handle in pending:
            group.start_soon(wait, handle)
        await anyio.sleep(0.01)  # let the waiters block
        started = time.monotonic()
        await world[0].close()
    elapsed = time.monotonic() - started

    assert elapsed < AT_ONCE
    assert len(errors) == 2
    assert "was pending when gang 'fake-world' was closed" in str(errors[0])
    # The closed gang took its ops back: their tensors are free for other gangs.
    assert await agang.FakeGang().all_reduce(tensor) is tensor


async def test_closing_fails_thread_waiters_too() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    handle = world[0].barrier()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            handle.wait(timeout=PATIENCE)
        except agang.GangClosedError as error:
            errors.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    await world[0].close()
    await anyio.to_thread.run_sync(thread.join, PATIENCE)

    assert len(errors) == 1


# Deadlines.


async def test_a_missed_deadline_raises_gang_timeout_error() -> None:
    world = FakeWorld(2, op_timeout=0.2)
    world[0].barrier()
    await world[1].barrier()  # seq 0 completes on rank 1; rank 0 awaits nothing

    started = time.monotonic()
    with pytest.raises(agang.GangTimeoutError) as info:
        await world[0].all_reduce(torch.ones(2))  # rank 1 never issues it
    elapsed = time.monotonic() - started

    error = info.value
    assert isinstance(error, TimeoutError)
    assert isinstance(error, agang.GangError)
    assert isinstance(error, agang.CollectiveError)
    assert 0.2 <= elapsed < 2.0
    assert error.context == agang.OpContext(
        gang="fake-world", rank=0, size=2, op="all_reduce", seq=1, timeout=0.2
    )
    assert 0.2 <= error.elapsed < 2.0
    assert any("barrier seq=0" in line for line in error.recent)
    assert "`all_reduce` (seq 1)" in str(error)
    assert "timed out" in str(error)


async def test_a_per_call_timeout_overrides_the_default() -> None:
    world = FakeWorld(2, op_timeout=30.0)

    started = time.monotonic()
    with pytest.raises(agang.GangTimeoutError) as info:
        await world[0].barrier(timeout=0.2)

    assert time.monotonic() - started < 2.0
    assert info.value.context.timeout == 0.2


async def test_a_per_call_timeout_longer_than_the_default_is_honoured() -> None:
    world = FakeWorld(2, op_timeout=0.05)
    late = world[0].barrier(timeout=PATIENCE)
    forever = world[0].barrier(timeout=math.inf)

    await anyio.sleep(0.3)  # six times the default deadline
    world[1].barrier()
    world[1].barrier()

    await late
    await forever


async def test_a_straggler_within_the_deadline_is_no_timeout() -> None:
    world = FakeWorld(2, op_timeout=PATIENCE)
    early = world[0].all_reduce(torch.ones(1))

    await anyio.sleep(0.1)
    late = world[1].all_reduce(torch.ones(1))

    assert (await early).item() == (await late).item() == 2.0


async def test_a_timeout_breaks_the_gang() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    with pytest.raises(agang.GangTimeoutError) as info:
        await world[0].barrier(timeout=0.05)
    first_cause = info.value

    started = time.monotonic()
    with pytest.raises(agang.GangBrokenError) as broken:
        world[0].all_reduce(torch.ones(1))
    with pytest.raises(agang.GangBrokenError):
        world[0].barrier()
    with pytest.raises(agang.GangBrokenError):
        await world[0].create_gang([0, 1])
    assert time.monotonic() - started < AT_ONCE

    assert broken.value.__cause__ is first_cause
    assert broken.value.first_cause is first_cause
    assert "broken" in str(broken.value)
    assert world[0].statistics().num_issued == 1  # the refused calls issued nothing


async def test_a_timeout_fails_the_other_pending_handles_with_gang_broken_error() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensor = torch.ones(2)
    doomed = world[0].barrier(timeout=0.1)
    others = [world[0].all_reduce(tensor), world[0].all_gather_objects("x")]

    with pytest.raises(agang.GangTimeoutError) as info:
        await doomed
    for handle in others:
        with pytest.raises(agang.GangBrokenError) as broken:
            await handle
        assert broken.value.first_cause is info.value
        assert broken.value.__cause__ is info.value

    # The broken gang's communicator was aborted: the ops' tensors are free again.
    assert await agang.FakeGang().all_reduce(tensor) is tensor


@pytest.mark.parametrize("failure", ["timeout", "ranks-disagree"])
async def test_the_gang_is_broken_before_any_waiter_wakes(failure: str) -> None:
    # A deadline can fire on a timer thread and c10d reports on its own threads; a waiter
    # woken by the failure that calls again at once must find the gang broken already.
    world = FakeWorld(2, op_timeout=math.inf)
    if failure == "timeout":
        handle = world[0].all_reduce(torch.ones(1), timeout=0.05)
    else:
        handle = world[0].all_reduce(torch.ones(1))
        world[1].barrier()
    next_call: list[str] = []

    def call_again() -> None:
        try:
            world[0].barrier()
        except agang.GangBrokenError:
            next_call.append("refused")
        else:
            next_call.append("accepted")

    # The hook that wakes ``await`` and ``wait()``, run on the thread that finishes.
    handle._add_done_callback(call_again)
    with pytest.raises(agang.GangError):
        await handle

    assert next_call == ["refused"]


async def test_a_cancelled_waiter_then_a_peer_that_never_comes() -> None:
    # 1 s: 100 times the waiter's 0.01 s (with 0.2 s, CI's loaded machine once stalled
    # the loop past the op's deadline before the waiter's cancel was seen).
    world = FakeWorld(2, op_timeout=1.0)
    handle = world[0].all_reduce(torch.ones(1))

    with anyio.move_on_after(0.01):
        await handle

    assert not handle.done()
    with pytest.raises(agang.GangTimeoutError):
        await handle
    assert handle.elapsed is not None
    assert handle.elapsed < 2.0
    with pytest.raises(agang.GangBrokenError):
        world[0].barrier()


# Cancellation.


async def test_a_cancelled_wait_leaves_the_op_running() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensors = [torch.full((2,), 1.0), torch.full((2,), 2.0)]
    handle = world[0].all_reduce(tensors[0])

    with anyio.move_on_after(0.02) as scope:
        await handle
    assert scope.cancelled_caught
    assert not handle.done()

    # While it runs, its tensor (or any view of it) is refused, by any gang.
    with pytest.raises(agang.TensorBusyError, match="`tensor`"):
        world[0].broadcast(tensors[0])
    with pytest.raises(agang.TensorBusyError, match="`input`"):
        world[0].all_gather(torch.empty(2, 1), tensors[0][1:])
    with pytest.raises(agang.TensorBusyError):
        agang.FakeGang().all_reduce(tensors[0].view(2, 1))

    await world[1].all_reduce(tensors[1])
    assert await handle is tensors[0]
    assert tensors[0].tolist() == [3.0, 3.0]
    # Finished: the tensor is usable again, and the ranks are still in step.
    handles = [gang.broadcast(t) for gang, t in zip(world, tensors, strict=True)]
    assert [h.seq for h in handles] == [1, 1]
    for h in handles:
        await h


async def test_fail_after_around_an_await_leaves_the_op_running() -> None:
    world = FakeWorld(2, op_timeout=math.inf, latency=0.2)
    tensors = [torch.full((2,), 1.0), torch.full((2,), 2.0)]
    handles = [gang.all_reduce(t) for gang, t in zip(world, tensors, strict=True)]

    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.01):
            await handles[0]

    assert not handles[0].done()
    with pytest.raises(agang.TensorBusyError):
        world[0].all_reduce(tensors[0])
    assert await handles[0] is tensors[0]
    assert await handles[1] is tensors[1]
    assert tensors[0].tolist() == tensors[1].tolist() == [3.0, 3.0]


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
async def test_asyncio_wait_for_around_an_await_leaves_the_op_running() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensor = torch.ones(2)
    handle = world[0].all_reduce(tensor)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(handle, timeout=0.02)

    assert not handle.done()
    await world[1].all_reduce(torch.ones(2))
    assert await handle is tensor


async def test_cancelling_a_task_group_leaves_the_op_running() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensors = [torch.full((1,), 1.0), torch.full((1,), 2.0)]
    handle = world[0].all_reduce(tensors[0])
    reached: list[str] = []

    async def waiter() -> None:
        try:
            await handle
        finally:
            reached.append("cancelled")

    async with anyio.create_task_group() as group:
        group.start_soon(waiter)
        await anyio.sleep(0.01)
        group.cancel_scope.cancel()

    assert reached == ["cancelled"]
    assert not handle.done()
    await world[1].all_reduce(tensors[1])
    assert (await handle).item() == 3.0


async def test_disjoint_slices_of_one_buffer_may_be_in_flight_at_once() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    buffers = [torch.arange(8.0) for _ in range(2)]

    # Both halves of rank 0's buffer are in flight: rank 1 has not issued yet.
    halves = [world[0].all_reduce(buffers[0][:4]), world[0].all_reduce(buffers[0][4:])]
    with pytest.raises(agang.TensorBusyError):
        world[0].all_reduce(buffers[0][3:5])  # overlaps both

    halves += [world[1].all_reduce(buffers[1][:4]), world[1].all_reduce(buffers[1][4:])]
    for handle in halves:
        await handle
    assert buffers[0].tolist() == buffers[1].tolist() == [2.0 * i for i in range(8)]


async def test_a_failing_sibling_leaves_no_stray_tasks_or_errors(
    anyio_backend_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensors = [torch.full((1,), 1.0), torch.full((1,), 2.0)]
    problems: list[dict[str, Any]] = []
    if anyio_backend_name == "asyncio":
        # What asyncio would log about a task or future left behind, caught at the source.
        loop = asyncio.get_running_loop()
        previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(lambda _, context: problems.append(context))

    async def waiter(handle: agang.Handle[Any]) -> None:
        await handle

    async def failing() -> None:
        await anyio.sleep(0.01)
        raise RuntimeError("a sibling failed")

    handles = [world[0].all_reduce(tensors[0]), world[0].barrier()]

    async def run_group() -> None:
        async with anyio.create_task_group() as group:
            for handle in handles:
                group.start_soon(waiter, handle)
            group.start_soon(failing)

    with caplog.at_level(logging.WARNING), pytest.raises(ExceptionGroup) as info:
        await run_group()
    assert info.group_contains(RuntimeError, match="a sibling failed")

    # The abandoned ops still complete when the peer comes.
    with caplog.at_level(logging.WARNING):
        await world[1].all_reduce(tensors[1])
        await world[1].barrier()
        assert (await handles[0]).item() == 3.0
        await handles[1]
        gc.collect()
        await anyio.sleep(0.01)
    if anyio_backend_name == "asyncio":
        loop.set_exception_handler(previous_handler)

    assert problems == []
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "destroyed" in m or "never retrieved" in m]


# Statistics.


async def test_statistics_count_ops_and_bytes() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    gang = world[0]
    assert gang.statistics().num_issued == 0
    assert gang.statistics().latency_p50 is None

    handle = gang.all_reduce(torch.ones(4))  # 16 bytes
    stats = gang.statistics()
    assert (stats.num_issued, stats.num_in_flight, stats.num_completed) == (1, 1, 0)
    assert (stats.bytes_issued, stats.bytes_in_flight) == (16, 16)

    world[1].all_reduce(torch.ones(4))
    await handle
    stats = gang.statistics()
    assert (stats.num_issued, stats.num_in_flight, stats.num_completed) == (1, 0, 1)
    assert (stats.bytes_issued, stats.bytes_in_flight) == (16, 0)
    assert stats.latency_p50 is not None
    assert stats.latency_max is not None
    assert 0 <= stats.latency_p50 <= stats.latency_max < PATIENCE
    assert (stats.num_failed, stats.num_timed_out) == (0, 0)


async def test_statistics_count_timeouts() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    await all_reduce_everywhere(world, [torch.ones(2), torch.ones(2)])

    with pytest.raises(agang.GangTimeoutError):
        await world[0].barrier(timeout=0.05)

    stats = world[0].statistics()
    assert (stats.num_issued, stats.num_completed, stats.num_timed_out) == (2, 1, 1)
    assert stats.num_failed == 0
    assert stats.num_in_flight == 0  # aborting the communicator ended the op
    assert stats.bytes_issued == 8


async def test_statistics_count_failures() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    # The ranks disagree: FakeWorld fails both sides, where c10d might hang.
    handles = [world[0].all_reduce(torch.ones(2)), world[1].barrier()]

    for handle in handles:
        with pytest.raises(agang.GangError, match="different collectives"):
            await handle

    for gang in world:
        stats = gang.statistics()
        assert (stats.num_issued, stats.num_failed, stats.num_completed) == (1, 1, 0)
        assert stats.num_in_flight == 0
        with pytest.raises(agang.GangBrokenError):
            gang.barrier()


# Independence.


async def test_two_worlds_are_independent() -> None:
    first, second = FakeWorld(2, op_timeout=math.inf), FakeWorld(2, op_timeout=math.inf)
    pending = first[0].all_reduce(torch.ones(1))

    # The other world's ops do not meet this one's, and are numbered on their own.
    handles = [gang.all_reduce(torch.full((1,), 5.0)) for gang in second]
    assert [(await h).item() for h in handles] == [10.0, 10.0]
    assert [h.seq for h in handles] == [0, 0]
    assert not pending.done()

    # Breaking one world leaves the other alone.
    with pytest.raises(agang.GangTimeoutError):
        await first[0].barrier(timeout=0.05)
    with pytest.raises(agang.GangBrokenError):
        await pending
    await all_reduce_everywhere(second, [torch.ones(1), torch.ones(1)])


# Sub-gangs.


async def test_create_gang_gives_members_a_sub_gang_and_others_none() -> None:
    world = FakeWorld(4)

    async def step(gang: agang.Gang) -> tuple[int, int, float] | None:
        sub = await gang.create_gang([3, 0, 2])  # order does not matter
        if sub is None:
            return None
        total = await sub.all_reduce(torch.full((1,), float(gang.rank)))
        return sub.rank, sub.size, total.item()

    assert await world.run(step) == [(0, 3, 5.0), None, (1, 3, 5.0), (2, 3, 5.0)]


async def test_sub_gangs_are_ordering_domains_of_their_own() -> None:
    world = FakeWorld(4)

    async def step(gang: agang.Gang) -> list[float]:
        pairs = [await gang.create_gang([0, 1]), await gang.create_gang([2, 3])]
        pair = pairs[0] or pairs[1]
        assert pair is not None
        assert (pair.rank, pair.size) == (gang.rank % 2, 2)
        # The pairs and the parent are separate: their ops may interleave differently.
        values = torch.full((1,), float(gang.rank))
        if gang.rank < 2:
            inner = await pair.all_reduce(values.clone())
            outer = await gang.all_reduce(values.clone())
        else:
            outer_handle = gang.all_reduce(values.clone())
            inner = await pair.all_reduce(values.clone())
            outer = await outer_handle
        gathered = await pair.all_gather_objects(gang.rank)
        assert gathered == [gang.rank - gang.rank % 2, gang.rank - gang.rank % 2 + 1]
        return [inner.item(), outer.item()]

    assert await world.run(step) == [[1.0, 6.0], [1.0, 6.0], [5.0, 6.0], [5.0, 6.0]]


async def test_closing_a_parent_closes_its_sub_gangs() -> None:
    world = FakeWorld(2)
    subs = await world.run(lambda gang: gang.create_gang([0, 1]))
    assert all(sub is not None for sub in subs)

    await world[0].close()

    assert subs[0] is not None
    assert subs[0].closed
    with pytest.raises(agang.GangClosedError):
        subs[0].barrier()
    assert subs[1] is not None
    assert not subs[1].closed


@pytest.mark.parametrize("kind", ["lane", "sub-gang"])
async def test_a_child_made_while_its_parent_closes_is_closed_too(kind: str) -> None:
    """Rank 0's parent closes while rank 0 waits for rank 1 to make a child with it;
    the child made then must not stay open over its closed parent (it did before)."""

    def make(gang: agang.Gang) -> Any:
        return gang.lane("side") if kind == "lane" else gang.create_gang([0, 1])

    world = FakeWorld(2)
    outcome: dict[str, Any] = {}

    async def rank_0() -> None:
        try:
            outcome["child"] = await make(world[0])
        except agang.GangClosedError as error:
            outcome["error"] = error

    async with anyio.create_task_group() as group:
        group.start_soon(rank_0)
        await anyio.sleep(0.1)  # rank 0 waits for rank 1 inside the making
        await world[0].close()
        with anyio.fail_after(PATIENCE):
            await make(world[1])

    assert "error" in outcome, outcome
    assert world[0].closed


async def test_fake_gang_create_gang() -> None:
    gang = agang.FakeGang(rank=1, size=4)

    sub = await gang.create_gang([3, 1])
    assert sub is not None
    assert (sub.rank, sub.size) == (0, 2)
    assert await gang.create_gang([0, 2]) is None
    assert (await sub.all_reduce(torch.ones(1))).item() == 2.0
