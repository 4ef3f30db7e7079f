"""The deadline driver (``agang._engine.deadlines``): one pending check per gang, never lost.

On FakeWorld: a rank that does not issue plays a peer that never comes, so an op of
the other rank can only end by its deadline. Bounds keep a 10x margin.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import anyio
import pytest
import torch
import trio

import agang
from agang._engine import deadlines
from agang.testing import FakeWorld

TIMEOUT = 0.3
PATIENCE = 10 * TIMEOUT


def _issue_on_a_loop_that_then_ends(world: FakeWorld) -> agang.Handle[torch.Tensor]:
    async def issue() -> agang.Handle[torch.Tensor]:
        return world[0].all_reduce(torch.ones(2))  # rank 1 never joins

    return asyncio.run(issue())


def test_a_deadline_armed_on_a_loop_that_ended_fires_for_a_thread_waiting_later() -> None:
    """The check was armed on ``asyncio.run``'s loop, which closed before it was due; a
    synchronous ``wait`` afterwards re-arms it (on the timer thread) instead of waiting
    for ever, or for the wait's own timeout."""
    world = FakeWorld(2, op_timeout=TIMEOUT)
    handle = _issue_on_a_loop_that_then_ends(world)

    started = time.monotonic()
    with pytest.raises(agang.GangTimeoutError):
        handle.wait(timeout=10 * PATIENCE)
    assert time.monotonic() - started < PATIENCE


def test_a_deadline_armed_on_a_loop_that_ended_fires_for_a_later_await_on_trio() -> None:
    world = FakeWorld(2, op_timeout=TIMEOUT)
    handle = _issue_on_a_loop_that_then_ends(world)

    async def wait() -> None:
        with anyio.fail_after(PATIENCE):
            await handle

    with pytest.raises(agang.GangTimeoutError):
        trio.run(wait)


@pytest.mark.anyio
async def test_re_arming_for_an_earlier_deadline_cancels_the_check_it_replaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """100 ops with ever earlier deadlines re-arm 100 times; each re-arm cancels the
    check before it, so one check is pending at the end, not 100."""
    armed: list[list[bool]] = []  # per armed check: [cancelled?]
    real_call_at = deadlines.call_at

    def counting_call_at(driver: object, when: float, callback: Any) -> deadlines.Cancel:
        cancel = real_call_at(driver, when, callback)
        state = [False]
        armed.append(state)

        def counted_cancel() -> None:
            state[0] = True
            cancel()

        return counted_cancel

    monkeypatch.setattr(deadlines, "call_at", counting_call_at)
    world = FakeWorld(2, op_timeout=60.0)
    handles = [world[0].all_reduce(torch.ones(1), timeout=60.0 - i * 0.1) for i in range(100)]

    assert len(armed) == 100
    assert [state[0] for state in armed] == [True] * 99 + [False]
    for rank, gang in enumerate(world):
        if rank:
            for _ in handles:
                gang.all_reduce(torch.ones(1))
    for handle in handles:
        await handle
    for gang in world:
        await gang.close()


@pytest.mark.anyio
async def test_a_cancelled_call_does_not_run_on_the_loop() -> None:
    ran = threading.Event()
    cancel = deadlines.call_at(deadlines.current_driver(), time.monotonic() + 0.05, ran.set)
    cancel()
    await anyio.sleep(0.3)
    assert not ran.is_set()


def test_the_timer_thread_runs_calls_in_time_order_and_skips_cancelled_ones() -> None:
    order: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    deadlines.call_at(None, now + 0.2, lambda: (order.append("late"), done.set()))
    deadlines.call_at(None, now + 0.05, lambda: order.append("early"))
    cancel = deadlines.call_at(None, now + 0.1, lambda: order.append("cancelled"))
    cancel()

    assert done.wait(PATIENCE)
    assert order == ["early", "late"]


@pytest.mark.anyio
async def test_a_deadline_the_caller_catches_logs_no_warning_or_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What agang raises, it does not also log at WARNING or ERROR: a handled deadline
    # once printed its message twice (the error, and "Gang ... is broken" at ERROR).
    world = FakeWorld(2, op_timeout=60.0)
    with caplog.at_level(logging.INFO, logger="agang"), pytest.raises(agang.GangTimeoutError):
        await world[0].all_reduce(torch.ones(1), timeout=0.2)  # rank 1 never comes
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == []
    assert any("is broken" in r.getMessage() for r in caplog.records)  # at INFO
    for gang in world:
        await gang.close()
