"""Which async library runs the current thread: the one place agang asks.

agang is awaited from asyncio (uvloop is an asyncio loop), from trio, and called from
plain threads. Several parts need to know which: waking a waiter, arming a deadline
timer, telling which task owns a ``coalesce()`` scope, refusing to block a loop's
thread, and scheduling a simulated completion. They all ask here.

asyncio's ``_get_running_loop`` is the documented-stable way to ask without raising;
trio is imported lazily, since it is optional.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Literal

Library = Literal["asyncio", "trio"]


def asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio (or uvloop) loop running on this thread, or None."""
    return asyncio._get_running_loop()


def trio_token() -> Any | None:
    """The trio token of the run on this thread, or None (also without trio)."""
    try:
        import trio
    except ImportError:  # pragma: no cover - trio is an optional dependency
        return None
    try:
        return trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None


def current_library() -> Library | None:
    """The async library whose loop runs on this thread, or None for a plain thread."""
    if asyncio._get_running_loop() is not None:
        return "asyncio"
    return "trio" if trio_token() is not None else None


def current_owner() -> object:
    """The task running now (asyncio or trio) or, outside any loop, the thread."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return asyncio.current_task(loop)
    if trio_token() is not None:
        import trio

        return trio.lowlevel.current_task()
    return threading.get_ident()


def call_soon(callback: Callable[[], None]) -> bool:
    """Schedules ``callback`` on this thread's loop; False when no loop runs here."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        loop.call_soon(callback)
        return True
    token = trio_token()
    if token is None:
        return False
    token.run_sync_soon(callback)
    return True


async def checkpoint() -> None:
    """One pass of the running loop: lets every other ready task run, then resumes."""
    if asyncio._get_running_loop() is not None:
        await asyncio.sleep(0)
        return
    import trio

    await trio.lowlevel.checkpoint()
