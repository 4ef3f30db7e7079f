"""Counting the passes of the running loop: how often a task let the others run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio


class Passes:
    """The passes a ticker task saw, counted from when :func:`counting` yields."""

    count = 0


@contextlib.asynccontextmanager
async def counting() -> AsyncIterator[Passes]:
    """Runs a task that counts one per pass of the loop while the body runs; read
    ``passes.count`` inside the body (trio orders a pass's tasks at random, so one pass
    may count 0 to 2)."""
    passes = Passes()
    stop = anyio.Event()

    async def tick() -> None:
        while not stop.is_set():
            passes.count += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(tick)
        await anyio.lowlevel.checkpoint()  # the ticker is running
        passes.count = 0
        try:
            yield passes
        finally:
            stop.set()
