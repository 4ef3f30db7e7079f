"""Waking a task on its own loop when a handle finishes on some other thread.

A handle finishes on a backend thread (Gloo's worker, the CUDA watcher, the deadline
timer). The task awaiting it lives on an asyncio, uvloop or trio loop. The callback only
schedules a wake-up with the loop's thread-safe entry point, never touches the loop's
state itself, and swallows the error a closed loop raises: once the loop is gone there
is nobody left to wake.

Cancelling the awaiting task removes the callback and leaves the op running
(see ``_handle`` rule 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agang._handle import Handle


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _observe(handle: Handle[Any]) -> None:
    # How long the loop took to run this task once the op had finished: its lag.
    observer, finished_at = handle._observer, handle._finished_at
    if observer is not None and finished_at is not None:
        observer(time.monotonic() - finished_at)


async def wait_async(handle: Handle[Any]) -> None:
    """Suspends the current task until ``handle`` finishes; always a checkpoint."""
    # asyncio._get_running_loop is the cheap, documented-stable way to ask without raising.
    loop = asyncio._get_running_loop()
    if loop is not None:
        await _wait_asyncio(handle, loop)
    else:
        await _wait_trio(handle)


async def _wait_asyncio(handle: Handle[Any], loop: asyncio.AbstractEventLoop) -> None:
    if handle.done():
        await asyncio.sleep(0)
        return
    future: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve, future)

    handle._add_done_callback(wake)
    try:
        await future
    finally:
        handle._remove_done_callback(wake)
    _observe(handle)


async def _wait_trio(handle: Handle[Any]) -> None:
    try:
        import trio
    except ImportError:  # pragma: no cover - only without trio and outside asyncio
        raise RuntimeError(
            "An agang handle must be awaited from asyncio, uvloop or trio."
        ) from None
    try:
        token = trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise RuntimeError(
            "An agang handle must be awaited from asyncio, uvloop or trio."
        ) from None
    if handle.done():
        await trio.lowlevel.checkpoint()
        return
    event = trio.Event()

    def wake() -> None:
        # A finished run raises RunFinishedError: nobody is waiting any more.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(event.set)

    handle._add_done_callback(wake)
    try:
        await event.wait()
    finally:
        handle._remove_done_callback(wake)
    _observe(handle)
