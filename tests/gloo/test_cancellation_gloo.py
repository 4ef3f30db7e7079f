"""Cancellation on real Gloo ranks (fault scenarios F*).

Cancelling a waiter abandons the wait, never the op: the op runs on, holds its tensors
(busy, and referenced even when the caller dropped them) until c10d ends it, and still
times out at its deadline when the peer never comes.

One world per async backend runs every row in turn (a world costs seconds to start).
Rank 1 joins each op only once rank 0 has made its checks and says so with a barrier
on a control lane, so "still pending" never depends on timing; only F4 waits for a
deadline, on a lane of its own, which it breaks.

| row | test |
| --- | --- |
| F1 cancel a waiter | ``test_f1_*``; with ``move_on_after`` also ``test_gloo_faults.py::`` |
|   | ``test_cancelled_waiter_leaves_the_op_running`` (asyncio, trio) |
| F2 ``asyncio.wait_for`` / ``anyio.fail_after`` | ``test_f2_*`` |
| F3 cancel, then reuse the tensor | ``test_f3_*`` |
| F4 cancel, the peer never comes | ``test_f4_*`` |
| F5 a task group with a failing sibling | ``test_f5_*`` |

The same rows on FakeWorld are in ``test_lifecycle.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import torch

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo

Report = dict[str, Any]

ASYNC_BACKENDS = ["asyncio", "uvloop", "trio"]
# How long a waiter waits before it gives up: the ops it abandons are still pending.
GIVE_UP = 0.05
# F4's deadline (T) and the slack allowed past a deadline (ε).
T = 1.0
SLACK = 0.5 + 0.1 * T
# "At once": a refused call makes no c10d call; ten times what it should ever need.
AT_ONCE = 0.1
# Ample time for an op whose peer has come to complete (normally milliseconds).
PATIENCE = 10.0


def busy_refusals(calls: dict[str, Callable[[], object]]) -> dict[str, bool]:
    """For each call, whether it was refused with TensorBusyError (and issued nothing)."""
    refused = {}
    for name, call in calls.items():
        try:
            call()
        except agang.TensorBusyError:
            refused[name] = True
        else:
            refused[name] = False
    return refused


async def poll(condition: Callable[[], bool], seconds: float) -> bool:
    """Waits until ``condition()`` holds, for ``seconds`` at most, without awaiting any op."""
    for _ in range(int(seconds / 0.01)):
        if condition():
            return True
        await anyio.sleep(0.01)
    return condition()


async def completed(gang: agang.Gang, count: int) -> bool:
    """Waits until ``count`` ops of ``gang`` have completed."""
    return await poll(lambda: gang.statistics().num_completed >= count, PATIENCE)


async def _f1_cancel_a_waiter_task(gang: agang.Gang, control: agang.Gang) -> Report:
    """F1: the task awaiting an all_reduce is cancelled and the caller drops the tensor.

    The op keeps the tensor referenced and busy until it ends, and then completes.
    """
    if gang.rank == 1:
        await control.barrier()
        await gang.all_reduce(torch.full((8,), 2.0))
        await control.barrier()
        return {}
    num_completed = gang.statistics().num_completed
    handles: list[agang.Handle[torch.Tensor]] = []
    alive: list[weakref.ref[torch.Tensor]] = []

    async def waiter() -> None:
        tensor = torch.full((8,), 1.0)  # only this task and the op hold it
        alive.append(weakref.ref(tensor))
        handles.append(gang.all_reduce(tensor))
        await handles[0]

    async with anyio.create_task_group() as group:
        group.start_soon(waiter)
        await anyio.sleep(GIVE_UP)
        group.cancel_scope.cancel()
    gc.collect()
    report: Report = {
        "pending_after_cancel": not handles[0].done(),
        "referenced_while_pending": alive[0]() is not None,
    }
    # The handle is all the caller has left of the op: drop it too; the op holds on.
    handles.clear()
    gc.collect()
    report["referenced_without_handle"] = alive[0]() is not None
    held = alive[0]()
    assert held is not None
    report["refused"] = busy_refusals(
        {
            "all_reduce": functools.partial(gang.all_reduce, held),
            "broadcast of a view": functools.partial(gang.broadcast, held[2:4]),
        }
    )
    report["pending_before_peer"] = gang.statistics().num_in_flight == 1
    await control.barrier()  # now rank 1 joins the op
    report["completed"] = await completed(gang, num_completed + 1)
    report["result"] = held.tolist()
    del held
    gc.collect()
    report["freed_after_completion"] = await poll(lambda: alive[0]() is None, PATIENCE)
    await control.barrier()
    return report


async def _f2_deadline_around_an_await(gang: agang.Gang, control: agang.Gang) -> Report:
    """F2: ``anyio.fail_after`` (every backend) and ``asyncio.wait_for`` (asyncio) give up
    on an await; the op runs on, its tensor busy, and completes once the peer comes."""
    ways = ["fail_after"]
    with contextlib.suppress(RuntimeError):  # trio has no asyncio loop
        asyncio.get_running_loop()
        ways.append("wait_for")
    report: Report = {"ways": ways}
    for way in ways:
        tensor = torch.full((4,), float(gang.rank + 1))
        if gang.rank == 1:
            await control.barrier()
            await gang.all_reduce(tensor)
            continue
        handle = gang.all_reduce(tensor)
        raised: str | None = None
        try:
            if way == "fail_after":
                with anyio.fail_after(GIVE_UP):
                    await handle
            else:
                await asyncio.wait_for(handle, GIVE_UP)
        except TimeoutError as error:
            raised = type(error).__name__
        refused = busy_refusals({"all_reduce": functools.partial(gang.all_reduce, tensor)})
        pending = not handle.done()
        await control.barrier()
        report[way] = {
            "raised": raised,
            "pending": pending,
            "refused": refused,
            "result": (await handle).tolist(),
            "same_tensor": handle.result() is tensor,
        }
    return report


async def _f3_cancel_then_reuse(gang: agang.Gang, control: agang.Gang) -> Report:
    """F3: after a cancelled wait the tensor is refused while busy, accepted once done."""
    tensor = torch.full((8,), float(gang.rank + 1))
    if gang.rank == 1:
        await control.barrier()
        await gang.all_reduce(tensor)
        await gang.all_reduce(tensor)
        return {}
    handle = gang.all_reduce(tensor)
    with anyio.move_on_after(GIVE_UP) as scope:
        await handle
    output = torch.empty(2, 8)
    report: Report = {
        "cancelled": scope.cancelled_caught,
        "refused": busy_refusals(
            {
                "all_reduce": lambda: gang.all_reduce(tensor),
                "all_gather input": lambda: gang.all_gather(output, tensor),
                "broadcast of a view": lambda: gang.broadcast(tensor[2:4]),
                "bucketed": lambda: gang.all_reduce_bucketed([torch.ones(2), tensor]),
            }
        ),
    }
    await control.barrier()
    await handle
    report["first"] = tensor.tolist()
    reused = gang.all_reduce(tensor)  # accepted: the op that held it has ended
    report["reused_seq"] = reused.seq - handle.seq
    report["second"] = (await reused).tolist()
    return report


async def _f4_peer_never_comes(gang: agang.Gang, control: agang.Gang) -> Report:
    """F4: rank 0's waiter gives up at once and nobody awaits again; rank 1 never joins.
    The deadline still fires at T and breaks the gang; the root gang is untouched."""
    lane = await gang.lane("f4")
    if gang.rank == 1:
        await control.barrier()
        return {"root_after": (await gang.all_reduce(torch.ones(1))).item()}
    handle = lane.all_reduce(torch.ones(4), timeout=T)
    with anyio.move_on_after(GIVE_UP):
        await handle
    pending = not handle.done()
    # Nobody awaits the op any more: the deadline's timer alone must end it.
    await poll(handle.done, T + SLACK + PATIENCE)
    error = handle.exception() if handle.done() else None
    started = time.monotonic()
    try:
        _ = lane.all_reduce(torch.ones(1))
    except agang.GangBrokenError as broken:
        refusal: Report = {
            "took": time.monotonic() - started,
            "first_cause_is_the_timeout": broken.first_cause is error,
        }
    else:
        refusal = {}
    await control.barrier()
    return {
        "pending_after_cancel": pending,
        "error": type(error).__name__,
        "elapsed": handle.elapsed,
        "context": None
        if not isinstance(error, agang.GangTimeoutError)
        else (error.context.op, error.context.timeout),
        "refusal": refusal,
        "root_after": (await gang.all_reduce(torch.ones(1))).item(),
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def _f5_failing_sibling(gang: agang.Gang, control: agang.Gang) -> Report:
    """F5: tasks awaiting collectives share a task group with a sibling that fails.

    The group cancels them; their ops run on and complete when the peer comes, and
    nothing is reported about destroyed tasks or unretrieved exceptions.
    """
    # A line of the rank's own on its stderr: the test's proof that the capture works.
    os.write(2, f"F5 rank {gang.rank}: stderr is captured\n".encode())
    tensors = [torch.full((4,), float(gang.rank + 1)) for _ in range(3)]
    if gang.rank == 1:
        await control.barrier()
        mirrored: list[agang.Handle[Any]] = [
            gang.all_reduce(tensors[0]),
            gang.barrier(),
            gang.all_reduce(tensors[1]),
        ]
        for handle in mirrored:
            await handle
        await gang.all_reduce(tensors[2])
        return {}
    # What asyncio would report about a task or future left behind, caught at the source;
    # anything logged or warned about one, on any backend, caught too.
    problems: list[str] = []
    loop: asyncio.AbstractEventLoop | None = None
    with contextlib.suppress(RuntimeError):  # trio has no asyncio loop
        loop = asyncio.get_running_loop()
    if loop is not None:
        loop.set_exception_handler(lambda _, context: problems.append(str(context)))
    records = _Records()
    logging.getLogger().addHandler(records)
    num_completed = gang.statistics().num_completed
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        issued = anyio.Event()
        handles: list[agang.Handle[Any]] = [gang.all_reduce(tensors[0]), gang.barrier()]

        async def waiter(handle: agang.Handle[Any]) -> None:
            await handle

        async def issuer() -> None:
            handle = gang.all_reduce(tensors[1])  # only this task holds the handle
            issued.set()
            await handle

        async def failing() -> None:
            await issued.wait()
            await anyio.sleep(GIVE_UP)
            raise RuntimeError("a sibling failed")

        raised: list[str] = []
        try:
            async with anyio.create_task_group() as group:
                for handle in handles:
                    group.start_soon(waiter, handle)
                group.start_soon(issuer)
                group.start_soon(failing)
        except BaseExceptionGroup as group_error:
            raised = [type(e).__name__ for e in group_error.exceptions]
        pending = [not h.done() for h in handles] + [gang.statistics().num_in_flight == 3]
        await control.barrier()
        results = [(await handles[0]).tolist(), await handles[1]]
        all_completed = await completed(gang, num_completed + 3)
        # The tensor of the op whose only handle died with its task: still written.
        after = await gang.all_reduce(tensors[2])
        gc.collect()
        await anyio.sleep(0.05)  # let anything deferred be reported
    logging.getLogger().removeHandler(records)
    if loop is not None:
        loop.set_exception_handler(None)
    return {
        "raised": raised,
        "pending_after_group": pending,
        "results": results,
        "all_completed": all_completed,
        "issuer_tensor": tensors[1].tolist(),
        "after": after.tolist(),
        "problems": problems,
        "logged": records.messages,
        "warned": [str(w.message) for w in warned],
    }


async def _cancellation_rows(gang: agang.Gang) -> Report:
    control = await gang.lane("control")
    report: Report = {}
    for name, row in [
        ("f1", _f1_cancel_a_waiter_task),
        ("f2", _f2_deadline_around_an_await),
        ("f3", _f3_cancel_then_reuse),
        ("f5", _f5_failing_sibling),
        ("f4", _f4_peer_never_comes),  # last: it breaks a lane
    ]:
        report[name] = await row(gang, control)
        await control.barrier()
    started = time.monotonic()
    await gang.close()  # with F4's op still stuck in the backend
    report["close_took"] = time.monotonic() - started
    return report


@contextlib.contextmanager
def stderr_of_children() -> Iterator[Callable[[], str]]:
    """Sends file descriptor 2 to a file while the block runs; ranks started inside
    inherit it, so what they write up to their exit (loop shutdown included) is kept."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@pytest.fixture(scope="module", params=ASYNC_BACKENDS)
def world(request: pytest.FixtureRequest) -> tuple[str, Report, str]:
    backend: str = request.param
    with stderr_of_children() as read_stderr:
        reports = run_world(_cancellation_rows, 2, async_backend=backend, op_timeout=30.0)
        stderr = read_stderr()
    return backend, reports[0], stderr


def test_f1_a_cancelled_task_leaves_the_op_running_holding_its_tensor(
    world: tuple[str, Report, str],
) -> None:
    report = world[1]["f1"]

    assert report["pending_after_cancel"]
    assert report["referenced_while_pending"]
    assert report["referenced_without_handle"]
    assert report["refused"] == {"all_reduce": True, "broadcast of a view": True}
    assert report["pending_before_peer"]
    assert report["completed"]
    assert report["result"] == [3.0] * 8
    assert report["freed_after_completion"]  # held by the op, not leaked by it


def test_f2_a_deadline_around_an_await_leaves_the_op_running(
    world: tuple[str, Report, str],
) -> None:
    backend, report = world[0], world[1]["f2"]

    assert report["ways"] == ["fail_after"] + ([] if backend == "trio" else ["wait_for"])
    for way in report["ways"]:
        assert report[way] == {
            "raised": "TimeoutError",
            "pending": True,
            "refused": {"all_reduce": True},
            "result": [3.0] * 4,
            "same_tensor": True,
        }


def test_f3_a_cancelled_op_s_tensor_is_refused_while_busy_and_accepted_after(
    world: tuple[str, Report, str],
) -> None:
    report = world[1]["f3"]

    assert report["cancelled"]
    assert report["refused"] == {
        "all_reduce": True,
        "all_gather input": True,
        "broadcast of a view": True,
        "bucketed": True,
    }
    assert report["first"] == [3.0] * 8
    assert report["reused_seq"] == 1  # the refused calls took no sequence number
    assert report["second"] == [6.0] * 8


def test_f4_a_cancelled_op_whose_peer_never_comes_times_out_at_t(
    world: tuple[str, Report, str],
) -> None:
    report = world[1]["f4"]

    assert report["pending_after_cancel"]
    assert report["error"] == "GangTimeoutError"
    assert report["context"] == ("all_reduce", T)
    assert T <= report["elapsed"] < T + SLACK
    assert report["refusal"]["first_cause_is_the_timeout"]
    assert report["refusal"]["took"] < AT_ONCE
    assert report["root_after"] == 2.0


def test_f5_a_failing_sibling_leaves_no_stray_tasks_or_errors(
    world: tuple[str, Report, str],
) -> None:
    report, stderr = world[1]["f5"], world[2]

    assert report["raised"] == ["RuntimeError"]
    assert report["pending_after_group"] == [True, True, True]
    assert report["results"] == [[3.0] * 4, None]
    assert report["all_completed"]
    assert report["issuer_tensor"] == [3.0] * 4
    assert report["after"] == [3.0] * 4
    assert report["problems"] == []
    assert report["logged"] == []
    assert report["warned"] == []
    for text in ("Task was destroyed", "never retrieved", "Exception in callback", "Traceback"):
        assert text not in stderr, stderr
    # The capture saw the ranks' stderr (F4's broken lane is logged at INFO only, as the
    # error is raised to its caller: nothing of it there).
    assert "F5 rank 0: stderr is captured" in stderr, stderr
    assert "is broken" not in stderr, stderr


def test_closing_with_an_op_stuck_in_the_backend_is_prompt(
    world: tuple[str, Report, str],
) -> None:
    assert world[1]["close_took"] < 1.0
