"""Waking a task on its own loop when a future finishes on some other thread.

A future (an op's handle, an internal wait) finishes on a backend thread (Gloo's
worker, the CUDA watcher, the deadline timer). The task awaiting it lives on an
asyncio, uvloop or trio loop. The callback only schedules a wake-up with the loop's
thread-safe entry point, never touches the loop's state itself, and swallows the error
a closed loop raises: once the loop is gone there is nobody left to wake.

Cancelling the awaiting task removes the callback and leaves the work running
(the futures' rule that waiting never changes what is awaited).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from agang import _asynclib

if TYPE_CHECKING:
    from agang._future import Future


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def wait_async(future: Future[Any]) -> bool:
    """Suspends the current task until ``future`` finishes; always a checkpoint.

    Returns:
        Whether the task had to wait (the future was not finished yet).
    """
    loop = _asynclib.asyncio_loop()
    if loop is not None:
        return await _wait_asyncio(future, loop)
    return await _wait_trio(future)


async def _wait_asyncio(future: Future[Any], loop: asyncio.AbstractEventLoop) -> bool:
    if future.done():
        await asyncio.sleep(0)
        return False
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve, woken)

    future._add_done_callback(wake)
    try:
        await woken
    finally:
        future._remove_done_callback(wake)
    return True


async def _wait_trio(future: Future[Any]) -> bool:
    token = _asynclib.trio_token()
    if token is None:
        raise RuntimeError("An agang handle must be awaited from asyncio, uvloop or trio.")
    import trio

    if future.done():
        await trio.lowlevel.checkpoint()
        return False
    event = trio.Event()

    def wake() -> None:
        # A finished run raises RunFinishedError: nobody is waiting any more.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(event.set)

    future._add_done_callback(wake)
    try:
        await event.wait()
    finally:
        future._remove_done_callback(wake)
    return True
