"""The handle a collective returns: awaiting it, waiting on it from threads, its state.

Ops run on a FakeWorld, whose ops finish only once every rank has issued them: issuing
on some ranks only leaves a handle pending for as long as a test needs.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from typing import Any

import anyio
import pytest
import torch
from loop_passes import counting

import agang
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio

# Generous bounds: nothing here should take more than a fraction of this.
PATIENCE = 10.0


# What await returns.


async def test_await_returns_the_tensor_of_an_in_place_op() -> None:
    world = FakeWorld(2)
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]

    handles = [gang.all_reduce(t) for gang, t in zip(world, tensors, strict=True)]

    for handle, tensor in zip(handles, tensors, strict=True):
        assert await handle is tensor
        assert tensor.tolist() == [3.0, 3.0, 3.0]


async def test_await_returns_the_output_tensor() -> None:
    world = FakeWorld(2)

    async def step(gang: agang.Gang) -> None:
        output = torch.empty(2, 2)
        assert await gang.all_gather(output, torch.full((2,), float(gang.rank))) is output
        assert output.tolist() == [[0.0, 0.0], [1.0, 1.0]]

        shard = torch.empty(2)
        assert await gang.reduce_scatter(shard, torch.ones(2, 2)) is shard
        assert shard.tolist() == [2.0, 2.0]

        received = torch.empty(2)
        sent = torch.full((2,), float(gang.rank))
        assert await gang.all_to_all(received, sent) is received
        assert received.tolist() == [0.0, 1.0]

        tensor = torch.full((2,), float(gang.rank))
        assert await gang.broadcast(tensor, source_rank=1) is tensor
        assert tensor.tolist() == [1.0, 1.0]

    await world.run(step)


async def test_await_returns_a_list_for_list_and_object_ops() -> None:
    world = FakeWorld(2)

    async def step(gang: agang.Gang) -> None:
        outputs = [torch.empty(1), torch.empty(1)]
        gathered = await gang.all_gather_to_list(outputs, torch.full((1,), float(gang.rank)))
        assert isinstance(gathered, list)
        assert all(a is b for a, b in zip(gathered, outputs, strict=True))
        assert [t.item() for t in gathered] == [0.0, 1.0]

        objects = [{"from": gang.rank}]
        assert await gang.broadcast_objects(objects, source_rank=1) is objects
        assert objects == [{"from": 1}]

        assert await gang.all_gather_objects(("rank", gang.rank)) == [("rank", 0), ("rank", 1)]

    await world.run(step)


async def test_await_returns_none_for_barrier_and_send() -> None:
    world = FakeWorld(2)
    received = torch.empty(2)

    barriers = [gang.barrier() for gang in world]
    send = world[0].send(torch.ones(2), destination_rank=1)
    recv = world[1].recv(received, source_rank=0)

    assert [await handle for handle in barriers] == [None, None]
    assert await send is None
    assert await recv is received
    assert received.tolist() == [1.0, 1.0]


async def test_a_finished_handle_can_be_awaited_again() -> None:
    world = FakeWorld(2)
    tensors = [torch.ones(1), torch.ones(1)]
    handles = [gang.all_reduce(t) for gang, t in zip(world, tensors, strict=True)]

    first = await handles[0]
    await handles[1]

    assert await handles[0] is first
    assert handles[0].wait() is first


# done(), result(), exception().


async def test_state_before_and_after_completion() -> None:
    world = FakeWorld(2)
    tensors = [torch.ones(2), torch.ones(2)]
    handle = world[0].all_reduce(tensors[0])

    assert not handle.done()
    with pytest.raises(asyncio.InvalidStateError, match="has not finished"):
        handle.result()
    with pytest.raises(asyncio.InvalidStateError, match="has not finished"):
        handle.exception()

    await world[1].all_reduce(tensors[1])
    await handle

    assert handle.done()
    assert handle.result() is tensors[0]
    assert handle.exception() is None


async def test_state_of_a_failed_handle() -> None:
    world = FakeWorld(2)
    handle = world[0].all_reduce(torch.ones(2), timeout=0.05)

    with pytest.raises(agang.GangTimeoutError) as info:
        await handle

    assert handle.done()
    assert handle.exception() is info.value
    with pytest.raises(agang.GangTimeoutError) as again:
        handle.result()
    assert again.value is info.value


async def test_completion_is_never_run_inside_the_issuing_call() -> None:
    world = FakeWorld(2)
    first = world[0].barrier()

    last = world[1].barrier()  # every rank has issued: the op completes, but on the loop

    assert not first.done()
    assert not last.done()
    await first
    await last


# wait() from plain threads.


async def test_threads_wait_on_handles_that_the_loop_drives() -> None:
    world = FakeWorld(4)
    tensors = [torch.full((2,), float(rank)) for rank in range(4)]
    handles = [world[rank].all_reduce(tensors[rank]) for rank in range(3)]  # rank 3 is late
    results: dict[int, Any] = {}

    def wait(rank: int) -> None:
        results[rank] = handles[rank].wait(timeout=PATIENCE)

    threads = [threading.Thread(target=wait, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    await world[3].all_reduce(tensors[3])
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, PATIENCE)

    assert all(results[rank] is tensors[rank] for rank in range(3))
    assert all(t.tolist() == [6.0, 6.0] for t in tensors)


def test_threads_wait_on_handles_that_a_loop_in_another_thread_drives() -> None:
    world = FakeWorld(3, latency=0.02)
    issued: queue.Queue[agang.Handle[torch.Tensor]] = queue.Queue()

    async def step(gang: agang.Gang) -> float:
        handle = gang.all_reduce(torch.full((1,), float(gang.rank)))
        issued.put(handle)
        return (await handle).item()

    loop_results: list[list[float]] = []
    loop_thread = threading.Thread(target=lambda: loop_results.append(asyncio.run(world.run(step))))
    loop_thread.start()
    handles = [issued.get(timeout=PATIENCE) for _ in range(3)]
    outputs: list[float] = []
    waiters = [
        threading.Thread(target=lambda h=h: outputs.append(h.wait(timeout=PATIENCE).item()))
        for h in handles
    ]
    for waiter in waiters:
        waiter.start()
    for thread in [*waiters, loop_thread]:
        thread.join(PATIENCE)

    assert outputs == [3.0, 3.0, 3.0]
    assert loop_results == [[3.0, 3.0, 3.0]]


def test_wait_without_any_loop() -> None:
    world = FakeWorld(2, latency=0.02)  # the ops complete on agang's timer thread

    handles = [gang.all_reduce(torch.ones(2)) for gang in world]

    assert [h.wait(timeout=PATIENCE).tolist() for h in handles] == [[2.0, 2.0]] * 2


def test_wait_timeout_expiry_abandons_the_wait_not_the_op() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    tensors = [torch.ones(2), torch.full((2,), 2.0)]
    handle = world[0].all_reduce(tensors[0])

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="`wait`") as info:
        handle.wait(timeout=0.05)
    assert time.monotonic() - started < PATIENCE / 5
    assert type(info.value) is TimeoutError  # the wait's own, not a GangTimeoutError
    assert not handle.done()
    with pytest.raises(agang.TensorBusyError):
        world[0].broadcast(tensors[0])

    world[1].all_reduce(tensors[1])

    assert handle.wait(timeout=PATIENCE) is tensors[0]
    assert tensors[0].tolist() == [3.0, 3.0]


def test_wait_with_zero_timeout_polls() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    handle = world[0].barrier()

    with pytest.raises(TimeoutError):
        handle.wait(timeout=0)

    world[1].barrier()
    assert handle.wait(timeout=0) is None


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1.0, ValueError), (math.nan, ValueError), ("1", TypeError), (True, TypeError)],
)
def test_wait_checks_its_timeout(timeout: Any, error: type[Exception]) -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    handle = world[0].barrier()

    with pytest.raises(error, match="`timeout`"):
        handle.wait(timeout=timeout)

    world[1].barrier()
    assert handle.wait(timeout=PATIENCE) is None


def test_wait_raises_the_error_of_a_failed_op() -> None:
    world = FakeWorld(2, op_timeout=math.inf)
    handle = world[0].all_reduce(torch.ones(2))
    world[1].barrier()  # another op at the same position

    with pytest.raises(agang.GangError, match="different collectives"):
        handle.wait(timeout=PATIENCE)


def test_a_handle_is_not_done_until_its_gang_has_reacted() -> None:
    """The finisher's follow-up (breaking the gang) runs before ``done()`` turns True, so
    a caller that polls ``done()`` and calls again at once sees the gang already broken."""
    handle: agang.Handle[None] = agang.Handle(op="all_reduce", seq=0, num_bytes=4, timeout=None)
    reacting, may_go_on = threading.Event(), threading.Event()
    seen: list[bool] = []

    def react() -> None:
        reacting.set()
        assert may_go_on.wait(PATIENCE)

    finisher = threading.Thread(
        target=handle._finish, args=(None, RuntimeError("x")), kwargs={"then": react}
    )
    finisher.start()
    try:
        assert reacting.wait(PATIENCE)
        seen.append(handle.done())
        with pytest.raises(TimeoutError):
            handle.wait(timeout=0)
    finally:
        may_go_on.set()
        finisher.join(PATIENCE)
    assert seen == [False]
    assert handle.done()
    assert isinstance(handle.exception(), RuntimeError)


# Metadata.


async def test_metadata() -> None:
    world = FakeWorld(2, op_timeout=30.0, latency=0.05)

    before = time.monotonic()
    first = world[0].all_reduce(torch.ones(4))
    after = time.monotonic()
    second = world[0].all_gather(torch.empty(2, 4, dtype=torch.float64), torch.ones(4).double())
    third = world[0].barrier(timeout=2.5)
    fourth = world[0].all_gather_objects("x", timeout=math.inf)

    assert (first.op, second.op, third.op, fourth.op) == (
        "all_reduce",
        "all_gather",
        "barrier",
        "all_gather_objects",
    )
    assert [h.seq for h in (first, second, third, fourth)] == [0, 1, 2, 3]
    assert first.num_bytes == 4 * 4
    assert second.num_bytes == (2 * 4 + 4) * 8  # output and input
    assert third.num_bytes == 0
    assert fourth.num_bytes > 0  # the pickled object
    assert before <= first.issued_at <= after
    assert first.timeout == 30.0  # the gang's default
    assert third.timeout == 2.5
    assert fourth.timeout is None  # math.inf means none
    assert first.elapsed is None

    world[1].all_reduce(torch.ones(4))
    await first

    assert first.elapsed is not None
    assert 0.04 <= first.elapsed < PATIENCE  # the world's latency is 0.05 s
    # Finish the others, so nothing is left in flight.
    world[1].all_gather(torch.empty(2, 4, dtype=torch.float64), torch.ones(4).double())
    world[1].barrier()
    world[1].all_gather_objects("y")
    assert await fourth == ["x", "y"]


async def test_a_world_without_a_default_timeout() -> None:
    world = FakeWorld(2, op_timeout=math.inf)

    handles = [gang.barrier() for gang in world]

    assert [h.timeout for h in handles] == [None, None]
    for handle in handles:
        await handle


async def test_repr() -> None:
    world = FakeWorld(2)
    handle = world[0].all_reduce(torch.ones(4))

    assert repr(handle) == "<agang.Handle all_reduce seq=0 bytes=16 pending>"
    world[1].all_reduce(torch.ones(4))
    await handle
    assert repr(handle) == "<agang.Handle all_reduce seq=0 bytes=16 done>"

    failing = world[0].barrier(timeout=0.01)
    with pytest.raises(agang.GangTimeoutError):
        await failing
    assert repr(failing) == "<agang.Handle barrier seq=1 bytes=0 failed>"


# Loop passes: an await of a finished op returns at once, within a streak; every
# READY_STREAK + 1-th takes one pass, so a loop of such awaits still lets others run.


async def test_awaits_of_finished_ops_let_other_tasks_run_once_per_streak() -> None:
    from agang._runtime.future import READY_STREAK

    gang = agang.FakeGang()  # every op ends inside its call: finished when awaited
    tensor = torch.ones(1)
    num_awaits = 10 * (READY_STREAK + 1)
    async with counting() as passes:
        for _ in range(num_awaits):
            await gang.all_reduce(tensor)
        seen = passes.count
    # One pass per streak, not one per await (before: 160 for 160 awaits).
    assert seen == pytest.approx(num_awaits / (READY_STREAK + 1), abs=1)
    await gang.close()


async def test_a_cancelled_loop_of_awaits_of_finished_ops_stops_within_a_streak() -> None:
    from agang._runtime.future import READY_STREAK

    gang = agang.FakeGang()
    tensor = torch.ones(1)
    done = 0
    with anyio.CancelScope() as scope:
        scope.cancel()
        for _ in range(10 * READY_STREAK):
            await gang.all_reduce(tensor)
            done += 1
    assert scope.cancelled_caught
    assert done <= READY_STREAK
    await gang.close()


def test_a_pending_future_made_without_its_constructor_sets_what_the_constructor_sets() -> None:
    """``future.pending`` skips ``__init__`` for speed (a handle per op): it must set
    every slot the constructor sets, to the same values, so that a slot added to one
    and not the other fails here rather than as a rare AttributeError."""
    from agang._runtime import future

    class Sub(future.Future[int]):
        __slots__ = ()

    made, skipped = future.Future[int]("op"), future.pending(Sub, "op")
    slots = future.Future.__slots__
    for slot in slots:
        assert hasattr(skipped, slot), slot
        mine, theirs = getattr(made, slot), getattr(skipped, slot)
        assert type(mine) is type(theirs), slot
        if slot != "_lock":
            assert mine == theirs, slot
