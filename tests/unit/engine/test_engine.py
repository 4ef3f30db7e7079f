"""The engine's issuing (``agang._engine.engine``): an op that may start is started on
the caller's thread, and one that ends inside its start never enters the core, yet is
numbered, counted, recorded and holds its tensors while it runs, as any other op."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

import agang
from agang._backends.contract import Done
from agang._engine import busy
from agang._reduce_op import ReduceOp

pytestmark = pytest.mark.anyio

Start = Callable[[torch.Tensor, ReduceOp, Done], None]


def with_start(gang: agang.FakeGang, start: Start) -> None:
    """Makes ``gang``'s backend start its all-reduces with ``start``."""
    gang._backend.start_all_reduce = start  # type: ignore[method-assign]


async def test_an_op_that_ends_inside_its_start_is_counted_and_recorded() -> None:
    gang = agang.FakeGang(size=2, op_timeout=30.0)
    tensor = torch.ones(2)

    handle = gang.all_reduce(tensor)

    assert handle.done()
    assert handle.elapsed is not None
    assert handle.elapsed >= 0.0
    assert await handle is tensor
    stats = gang.statistics()
    assert (stats.num_issued, stats.num_completed, stats.num_in_flight) == (1, 1, 0)
    assert stats.bytes_issued == 8
    assert stats.latency_by_op["all_reduce"].count == 1
    assert [r.seq for r in gang._engine._scheduler.recent()] == [0]
    assert gang._engine._scheduler.next_deadline() is None
    assert busy.num_busy() == 0
    gang.close_sync()


async def test_its_tensor_is_busy_while_it_runs() -> None:
    gang, other = agang.FakeGang(size=2), agang.FakeGang(size=2)
    tensor = torch.ones(2)
    seen: list[BaseException] = []

    def start(t: torch.Tensor, op: ReduceOp, done: Done) -> None:
        try:
            other.all_reduce(t)
        except agang.TensorBusyError as exc:
            seen.append(exc)
        done(None)

    with_start(gang, start)
    await gang.all_reduce(tensor)

    assert len(seen) == 1
    assert "(seq 0)" in str(seen[0])
    assert busy.num_busy() == 0
    await other.all_reduce(tensor)  # free again


def test_is_busy_says_whether_any_of_a_tensors_memory_is_held() -> None:
    flat = torch.zeros(8)
    claim = busy.acquire_one("flat", flat[2:4], "an op")
    try:
        assert busy.is_busy(flat)  # overlaps the held slice
        assert busy.is_busy(flat[3:6])
        assert not busy.is_busy(flat[4:8])  # disjoint
        assert not busy.is_busy(flat[:0])  # no bytes
        assert busy.num_busy() == 1  # asking marks nothing
    finally:
        busy.release(claim)
    assert not busy.is_busy(flat)


async def test_an_op_that_keeps_running_enters_the_core() -> None:
    gang = agang.FakeGang(size=2, op_timeout=30.0)
    ends: list[Done] = []
    with_start(gang, lambda t, op, done: ends.append(done))

    handle = gang.all_reduce(torch.ones(2))

    assert not handle.done()
    assert gang.statistics().num_in_flight == 1
    assert gang._engine._scheduler.next_deadline() == handle.issued_at + 30.0
    ends[0](None)
    await handle
    stats = gang.statistics()
    assert (stats.num_completed, stats.num_in_flight) == (1, 0)


async def test_an_end_reported_by_another_thread_during_the_start_is_taken() -> None:
    gang = agang.FakeGang(size=2, op_timeout=30.0)

    def start(t: torch.Tensor, op: ReduceOp, done: Done) -> None:
        reporter = threading.Thread(target=done, args=(None,))
        reporter.start()
        time.sleep(0.05)  # the reporter waits for the gang's lock meanwhile

    with_start(gang, start)
    handle = gang.all_reduce(torch.ones(2))

    assert handle.wait(timeout=10.0) is not None
    stats = gang.statistics()
    assert (stats.num_completed, stats.num_in_flight) == (1, 0)
    assert [r.outcome for r in gang._engine._scheduler.recent()] == ["ok"]


@pytest.mark.parametrize("how", ["raises", "reports"])
async def test_a_failure_inside_the_start_fails_the_op_and_breaks_the_gang(how: str) -> None:
    gang = agang.FakeGang(size=2)

    def start(t: torch.Tensor, op: ReduceOp, done: Done) -> None:
        if how == "raises":
            raise RuntimeError("boom")
        done(RuntimeError("boom"))

    with_start(gang, start)
    handle = gang.all_reduce(torch.ones(2))

    with pytest.raises(agang.CollectiveError, match="boom"):
        await handle
    stats = gang.statistics()
    assert (stats.num_failed, stats.num_completed, stats.num_in_flight) == (1, 0, 0)
    assert [r.outcome for r in gang._engine._scheduler.recent()] == ["failed"]
    with pytest.raises(agang.GangBrokenError):
        gang.all_reduce(torch.ones(2))
    assert busy.num_busy() == 0


async def test_an_op_issued_inside_another_ops_start_starts_after_it() -> None:
    gang = agang.FakeGang(size=2)
    first, second = torch.ones(1), torch.ones(1)
    started: list[torch.Tensor] = []
    inner: list[agang.Handle[torch.Tensor]] = []

    def start(t: torch.Tensor, op: ReduceOp, done: Done) -> None:
        started.append(t)
        if t is first:
            inner.append(gang.all_reduce(second))  # re-entrant: queued, not nested
            assert started == [first]
        done(None)

    with_start(gang, start)
    handle = gang.all_reduce(first)

    assert started == [first, second]
    assert (handle.seq, inner[0].seq) == (0, 1)
    assert inner[0].done()
    await handle
    assert gang.statistics().num_completed == 2


async def test_an_ops_tensors_live_until_their_claim_is_released() -> None:
    # A backend may drop its references before it reports the end (FakeWorld moves the
    # data when the last rank arrives and reports later, on the loop). The claim on the
    # memory lasts until the report, so the memory must too: freed, it could go to a new
    # tensor, which the stale claim would refuse (seen as a flaky TensorBusyError).
    import gc
    import weakref

    from agang.testing import FakeWorld

    world = FakeWorld(2, op_timeout=30.0)
    outputs = [torch.zeros(2, 3) for _ in world]
    inputs = [torch.full((3,), float(rank)) for rank in range(2)]
    alive = weakref.ref(inputs[0])
    handles = [gang.all_gather(outputs[gang.rank], inputs[gang.rank]) for gang in world]
    del inputs
    gc.collect()

    assert not handles[0].done()  # the data moved; the report waits for the loop
    assert alive() is not None
    assert busy.num_busy() > 0
    for handle in handles:
        await handle
    gc.collect()
    assert alive() is None
    assert busy.num_busy() == 0
    assert outputs[1].tolist() == [[0.0] * 3, [1.0] * 3]
