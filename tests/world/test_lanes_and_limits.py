"""Lanes, in-flight bounds, the timeout policy, the flight recorder and statistics.

FakeWorld for the semantics; real Gloo ranks for lanes driven by concurrent tasks whose
interleaving differs by rank, and for ``on_timeout="raise"``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import agang
from agang.testing import FakeWorld, run_world

AT_ONCE = 1.0

# Lanes.


@pytest.mark.anyio
async def test_a_lane_is_made_once_per_name_and_closes_with_its_gang() -> None:
    world = FakeWorld(2)

    async def program(gang: agang.Gang) -> tuple[bool, bool, str, float]:
        grads = await gang.lane("grads")
        again = await gang.lane("grads")
        other = await gang.lane("metrics")
        total = (await grads.all_reduce(torch.ones(1))).item()
        return grads is again, grads is other, grads.name, total

    results = await world.run(program)
    assert results == [(True, False, "fake-world/lane:grads", 2.0)] * 2
    lane = await world[0].lane("grads")
    await world[0].close()
    assert lane.closed


@pytest.mark.anyio
async def test_lane_arguments_are_checked() -> None:
    gang = agang.FakeGang(size=2)
    with pytest.raises(ValueError, match="`name` must be a non-empty str"):
        await gang.lane("")
    with pytest.raises(TypeError, match="`high_priority` must be a bool"):
        await gang.lane("x", high_priority="yes")  # type: ignore[arg-type]
    await gang.lane("x")
    with pytest.raises(ValueError, match="`high_priority` must match"):
        await gang.lane("x", high_priority=True)


async def _two_tasks_on_two_lanes(gang: agang.Gang) -> list[list[float]]:
    """Two tasks issue on their own lanes; their interleaving differs by rank."""
    lanes = {name: await gang.lane(name) for name in ("a", "b")}
    results: dict[str, list[float]] = {"a": [], "b": []}
    pace = random.Random(gang.rank)

    async def task(name: str, base: float) -> None:
        lane = lanes[name]
        for step in range(30):
            if pace.random() < 0.3:
                await anyio.sleep(pace.random() * 0.003)
            value = torch.full((4,), base + step + gang.rank)
            handle = lane.all_reduce(value)
            if pace.random() < 0.5:
                await anyio.lowlevel.checkpoint()
            results[name].append((await handle)[0].item())

    async with anyio.create_task_group() as group:
        group.start_soon(task, "a", 0.0)
        group.start_soon(task, "b", 1000.0)
    return [results["a"], results["b"]]


def _expected_lane_sums(size: int) -> list[list[float]]:
    ranks = sum(range(size))
    return [[size * (base + step) + ranks for step in range(30)] for base in (0.0, 1000.0)]


@pytest.mark.anyio
async def test_two_tasks_on_two_lanes_on_fake_world() -> None:
    world = FakeWorld(3)
    assert await world.run(_two_tasks_on_two_lanes) == [_expected_lane_sums(3)] * 3


@pytest.mark.gloo
@pytest.mark.parametrize("async_backend", ["asyncio", "uvloop", "trio"])
def test_two_tasks_on_two_lanes_on_gloo(async_backend: str) -> None:
    results = run_world(_two_tasks_on_two_lanes, 2, async_backend=async_backend, timeout=90)
    assert results == [_expected_lane_sums(2)] * 2


# In-flight bounds.
#
# The queued count is read right after the issues, with no await between: on a world with
# no latency its ops end only on the loop, so none can end (and let a queued one start)
# before the read. With latency, trio's ops end on the timer thread, and on a loaded
# machine (an issue slowed to 1 ms) some ended while the ranks were still issuing: 5
# queued where 17 were due.


@pytest.mark.anyio
async def test_past_the_bound_ops_queue_in_call_order() -> None:
    world = FakeWorld(2, limits=agang.InFlightLimits(max_ops=3))

    async def program(gang: agang.Gang) -> tuple[int, list[int], list[float]]:
        handles = [gang.all_reduce(torch.full((1,), float(i))) for i in range(20)]
        queued = gang.statistics().num_queued
        values = [(await h).item() for h in handles]
        return queued, [h.seq for h in handles], values

    for queued, seqs, values in await world.run(program):
        assert queued == 17  # 3 started, the rest held by agang, not by the backend
        assert seqs == list(range(20))
        assert values == [2.0 * i for i in range(20)]


@pytest.mark.anyio
async def test_the_byte_bound_queues_too() -> None:
    limits = agang.InFlightLimits(max_bytes=4 * 1024)
    world = FakeWorld(2, limits=limits)

    async def program(gang: agang.Gang) -> tuple[int, float]:
        handles = [gang.all_reduce(torch.ones(1024)) for _ in range(4)]  # 4 KiB each
        queued = gang.statistics().num_queued
        return queued, sum([(await h).sum().item() for h in handles])

    assert await world.run(program) == [(3, 4 * 2048.0)] * 2


@pytest.mark.anyio
async def test_when_full_raise_refuses_without_issuing() -> None:
    limits = agang.InFlightLimits(max_ops=2, when_full="raise")
    world = FakeWorld(2, limits=limits)

    async def program(gang: agang.Gang) -> tuple[int, int]:
        handles = [gang.all_reduce(torch.ones(1)) for _ in range(2)]
        with pytest.raises(agang.GangFullError, match="when_full='raise'"):
            gang.all_reduce(torch.ones(1))
        for handle in handles:
            await handle
        later = gang.all_reduce(torch.ones(1))  # room again, and the numbering is intact
        await later
        return later.seq, gang.statistics().num_issued

    assert await world.run(program) == [(2, 3), (2, 3)]


def test_when_full_block_waits_on_a_thread_and_refuses_on_a_loop() -> None:
    limits = agang.InFlightLimits(max_ops=1, when_full="block")
    world = FakeWorld(2, limits=limits)
    first = world[0].all_reduce(torch.ones(1))
    got: list[agang.Handle[torch.Tensor]] = []

    def caller() -> None:  # blocks until rank 1 meets the first op
        got.append(world[0].all_reduce(torch.ones(1)))

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.2)
    assert got == []  # still blocked
    world[1].all_reduce(torch.ones(1))  # no loop here: the op finishes at once
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert first.done()
    assert got[0].seq == 1

    async def on_a_loop() -> None:
        with pytest.raises(RuntimeError, match="would block the event loop"):
            world[0].all_reduce(torch.ones(1))

    anyio.run(on_a_loop)  # seq 1 is still in flight: the gang is full
    world[1].all_reduce(torch.ones(1))
    assert got[0].wait(timeout=5).item() == 2.0


@pytest.mark.anyio
async def test_wait_for_room_keeps_a_producer_within_the_bounds() -> None:
    """A producer that awaits room before each call never makes the gang queue: at most
    ``max_ops`` are ever admitted, although rank 1 joins only one op at a time, late."""
    limits = agang.InFlightLimits(max_ops=3)
    world = FakeWorld(2, limits=limits)
    most_admitted = 0

    async def producer() -> list[float]:
        nonlocal most_admitted
        handles = []
        for _ in range(12):
            await world[0].wait_for_room(4)
            handles.append(world[0].all_reduce(torch.ones(1)))
            stats = world[0].statistics()
            most_admitted = max(most_admitted, stats.num_in_flight)
            assert stats.num_queued == 0
        return [(await handle).item() for handle in handles]

    async def slow_peer() -> None:
        for _ in range(12):
            await anyio.sleep(0.01)
            await world[1].all_reduce(torch.ones(1))

    async with anyio.create_task_group() as group:
        group.start_soon(slow_peer)
        sums = await producer()
    assert sums == [2.0] * 12
    assert most_admitted == 3


@pytest.mark.anyio
async def test_wait_for_room_yields_and_fails_with_the_gang() -> None:
    world = FakeWorld(2, limits=agang.InFlightLimits(max_ops=1))
    await world[0].wait_for_room()  # room at once: still a checkpoint, and no error
    pending = world[0].all_reduce(torch.ones(1))  # rank 1 never joins: the gang is full

    async def close_soon() -> None:
        await anyio.sleep(0.05)
        await world[0].close()

    async with anyio.create_task_group() as group:
        group.start_soon(close_soon)
        with anyio.fail_after(5), pytest.raises(agang.GangClosedError):
            await world[0].wait_for_room()
    assert pending.done()
    with pytest.raises(agang.GangClosedError):
        await world[0].wait_for_room()


def test_wait_for_room_checks_num_bytes() -> None:
    gang = agang.FakeGang(rank=0, size=2)
    with pytest.raises(ValueError, match="`num_bytes` must be 0 or more, but is -1"):
        anyio.run(gang.wait_for_room, -1)
    with pytest.raises(TypeError, match="`num_bytes` must be an int"):
        anyio.run(gang.wait_for_room, 1.5)


def test_in_flight_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="`max_ops`"):
        agang.InFlightLimits(max_ops=0)
    with pytest.raises(ValueError, match="`max_bytes`"):
        agang.InFlightLimits(max_bytes=-1)
    with pytest.raises(ValueError, match="`when_full` must be one of"):
        agang.InFlightLimits(when_full="drop")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`limits` must be"):
        agang.FakeGang(limits=64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`on_timeout` must be one of"):
        agang.FakeGang(on_timeout="ignore")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`check_order` must be"):
        agang.FakeGang(check_order="yes")  # type: ignore[arg-type]


# The timeout policy and the flight recorder.


@pytest.mark.anyio
async def test_on_timeout_raise_fails_only_that_op() -> None:
    world = FakeWorld(2, op_timeout=0.3, on_timeout="raise")
    tensor = torch.ones(2)
    late = world[0].all_reduce(tensor)
    with pytest.raises(agang.GangTimeoutError, match="the gang stays usable") as caught:
        await late
    assert caught.value.context.seq == 0
    with pytest.raises(agang.TensorBusyError):  # c10d may still write into it
        world[0].all_reduce(tensor)
    world[1].all_reduce(torch.ones(2))  # the peer comes at last
    with anyio.fail_after(AT_ONCE * 5):
        while world[0].statistics().num_in_flight:  # noqa: ASYNC110  # no event to wait on
            await anyio.sleep(0.01)
    assert tensor.tolist() == [2.0, 2.0]  # the op finished, into the tensor
    handles = [gang.all_reduce(torch.ones(1)) for gang in world]
    assert [(await h).item() for h in handles] == [2.0, 2.0]  # not broken
    stats = world[0].statistics()
    assert (stats.num_timed_out, stats.num_completed) == (1, 1)


@pytest.mark.anyio
async def test_a_timeout_carries_the_flight_recorder() -> None:
    world = FakeWorld(2, op_timeout=5.0)
    for _ in range(3):
        handles = [gang.all_reduce(torch.ones(8)) for gang in world]
        for handle in handles:
            await handle
    stuck = world[0].all_reduce(torch.ones(4), timeout=0.2)
    also = world[0].broadcast(torch.ones(2))
    with pytest.raises(agang.GangTimeoutError) as caught:
        await stuck
    error = caught.value
    assert error.context.op == "all_reduce"
    assert error.context.timeout == 0.2
    assert len(error.in_flight) == 1
    assert error.in_flight[0].startswith("broadcast seq=4 8 B")
    assert [line.split(" B ")[0] for line in error.recent] == [
        "all_reduce seq=0 32",
        "all_reduce seq=1 32",
        "all_reduce seq=2 32",
    ]
    with pytest.raises(agang.GangBrokenError):
        await also


# Statistics.


@pytest.mark.anyio
async def test_statistics_have_latency_per_op_and_loop_lag() -> None:
    world = FakeWorld(2, latency=0.01)

    async def program(gang: agang.Gang) -> agang.GangStatistics:
        for _ in range(5):
            await gang.all_reduce(torch.ones(1))
        await gang.broadcast(torch.ones(1))
        return gang.statistics()

    stats = (await world.run(program))[0]
    assert set(stats.latency_by_op) == {"all_reduce", "broadcast"}
    reduce = stats.latency_by_op["all_reduce"]
    assert reduce.count == 5
    assert 0.005 < reduce.p50 <= reduce.max < 5.0
    assert stats.latency_by_op["broadcast"].count == 1
    assert stats.loop_lag is not None
    assert stats.loop_lag.count >= 6
    assert 0 <= stats.loop_lag.max < AT_ONCE
    assert stats.num_queued == 0
    assert stats.num_in_flight == 0


@pytest.mark.gloo
def test_on_timeout_raise_on_gloo() -> None:
    results = run_world(_raise_policy_program, 2, timeout=60, init_options={"on_timeout": "raise"})
    assert results[0] == {"timed_out": True, "then": 2.0, "broken": False, "value": [2.0]}


async def _raise_policy_program(gang: agang.Gang) -> dict[str, Any]:
    report: dict[str, Any] = {"timed_out": False}
    tensor = torch.ones(1)
    if gang.rank == 0:
        try:
            await gang.all_reduce(tensor, timeout=0.5)
        except agang.GangTimeoutError:
            report["timed_out"] = True
    else:
        await anyio.sleep(1.5)  # 3x the deadline
        await gang.all_reduce(tensor)
    report["then"] = (await gang.all_reduce(torch.ones(1))).item()
    report["broken"] = gang.statistics().num_failed > 0
    report["value"] = tensor.tolist()
    return report


async def _lanes_in_opposite_orders(gang: agang.Gang) -> tuple[list[str], float]:
    """Rank 0 asks for lane "grads" then "metrics", rank 1 the reverse; then "grads"
    alone, in one order."""
    errors = []
    for name in ("grads", "metrics") if gang.rank == 0 else ("metrics", "grads"):
        try:
            await gang.lane(name)
        except agang.GangInitError as error:
            errors.append(str(error))
    grads = await gang.lane("grads")
    return errors, (await grads.all_reduce(torch.ones(1))).item()


def _check_refused_not_crossed(results: list[tuple[list[str], float]], gang: str) -> None:
    for errors, total in results:
        assert len(errors) == 2, errors
        for error in errors:
            assert "made by one call with other gangs on other ranks" in error, error
            assert f"'{gang}/lane:grads'" in error, error
            assert f"'{gang}/lane:metrics'" in error, error
        assert total == 2.0  # made again in one order, the lane works


@pytest.mark.anyio
async def test_lanes_made_in_another_order_on_another_rank_are_refused_not_crossed() -> None:
    """The groups pair up by call order, so each call would get the other rank's other
    lane: every rank is refused, naming both lanes, and no op runs on a crossed pair."""
    world = FakeWorld(2)
    _check_refused_not_crossed(await world.run(_lanes_in_opposite_orders), "fake-world")
    for gang in world:
        await gang.close()


@pytest.mark.gloo
def test_lanes_made_in_another_order_are_refused_on_gloo() -> None:
    # Without the check, rank 0's "grads" and rank 1's "metrics" were one group: 201 for
    # 3 and 102 for 300 in the reproduction.
    results = run_world(_lanes_in_opposite_orders, 2, async_backend="asyncio", timeout=60.0)
    _check_refused_not_crossed(results, "root")
