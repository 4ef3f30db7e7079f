"""The channel's small waits: a blocking call off the loop with a bound, a heartbeat
thread, and the event loop of the ``*_sync`` methods."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import sniffio

from agang._errors import GangInitError
from agang._runtime import threads
from agang._runtime.threads import run_blocking, start_daemon
from agang._weights import channel as channel_keys

T = TypeVar("T")


def bound(deadline: float, least: float = 0.1) -> float:
    """The seconds left before ``deadline`` (at least ``least``; a day for none)."""
    return max(least, min(deadline - time.monotonic(), 86400.0))


async def blocking(fn: Callable[[], T], seconds: float, *, what: str) -> T:
    """``fn()`` on a thread of its own, given up after ``seconds`` (naming ``what``)."""
    boxed = await run_blocking(lambda: (fn(),), name=f"weights: {what}", seconds=seconds)
    if boxed is None:
        raise GangInitError(
            f"The weights channel gave up on {what} after {seconds:.1f} s: the store did "
            f"not answer (stopped, or this process cut off from it)."
        )
    return boxed[0]


def beat(say: Callable[[int], None], name: str) -> threading.Event:
    """Calls ``say(1)``, ``say(2)``, ... every ``BEAT`` seconds until the event is set
    or the store fails."""
    stop = threading.Event()

    def run() -> None:
        count = 0
        while not stop.wait(channel_keys.BEAT):
            count += 1
            try:
                say(count)
            except Exception:
                return

    start_daemon(run, name=f"agang: weights beat ({name})")
    threads.at_exit(stop=stop.set)
    return stop


def run_sync(fn: Callable[[], Any]) -> Any:
    """Runs the coroutine function ``fn`` to its end on an event loop of this thread."""
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(fn)
    raise RuntimeError(
        "The *_sync methods are for code without a running event loop: await instead."
    )
