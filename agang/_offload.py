"""Running a blocking call (c10d set-up, destroy, store waits) off the event loop.

Each call gets its own daemon thread: these calls are rare (init, create_gang, close),
and a daemon thread stuck in c10d can never keep the process from exiting, which a
pooled non-daemon worker could. The caller awaits a handle the thread finishes, so the
wait is cancellable on every backend; a cancelled or timed-out call leaves its thread to
end on its own (c10d gets a bounded timeout of its own from the caller).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from agang._handle import Handle

T = TypeVar("T")


def start_thread(fn: Callable[[], T], *, name: str) -> Handle[T]:
    """Runs ``fn`` on a new daemon thread; the handle finishes with its result."""
    handle: Handle[Any] = Handle(op=name, seq=0, num_bytes=0, timeout=None)

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            handle._finish(None, exc)
        else:
            handle._finish(value, None)

    threading.Thread(target=run, name=f"agang: {name}", daemon=True).start()
    return handle


async def run_blocking(fn: Callable[[], T], *, name: str, seconds: float | None) -> T | None:
    """Awaits ``fn()`` run on a daemon thread, giving up after ``seconds``.

    Returns:
        ``fn``'s result, or None if ``seconds`` passed first (the thread is left to end).
    """
    handle = start_thread(fn, name=name)
    with anyio.move_on_after(seconds):
        return await handle
    return None
