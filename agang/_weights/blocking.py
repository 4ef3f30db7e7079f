"""The channel's waits: a blocking call off the loop with a bound, and the event loop
of the ``*_sync`` methods.

Rules:
1. A store call, or a group's making, runs on a thread of its own (``blocking``), given
   up on after its bound: the error names what was waited for and the store, since the
   only calls that block so are the store's, once it stops answering. A store call
   that fails (its connection broke: the store died) fails as ``StoreTrouble``, a
   ``GangError`` that names the store, never as c10d's raw error.
2. A call given up on (its bound passed, or its awaiter was cancelled) goes on on its
   thread: what it returns then is handed to ``abandoned``, so that a group made for
   nobody is closed rather than left connected to the members (a push cancelled while
   it made its epoch's group did).
3. No deadline is ``math.inf``; a wait bounded by it is bounded by a day.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import sniffio

from agang._errors import GangError, one_line
from agang._runtime.future import Future, add_done_callback
from agang._runtime.threads import start_thread

T = TypeVar("T")

#: The longest wait "no deadline" stands for (rule 3).
_DAY = 86400.0
#: The longest a store step of a push may take past the push's own bound.
STEP_SECONDS = 5.0


def bound(deadline: float, least: float = 0.1) -> float:
    """The seconds left before ``deadline`` (at least ``least``; a day for none)."""
    if math.isinf(deadline):
        return _DAY
    return max(least, min(deadline - time.monotonic(), _DAY))


class StoreTrouble(GangError):
    """A store call failed, or did not end within its bound (rule 1)."""


def store_trouble(what: str, store: str, error: BaseException) -> StoreTrouble:
    """The error of ``what``, which the store at ``store`` failed with ``error``."""
    return StoreTrouble(
        f"The weights channel could not finish {what}: the store at {store} failed "
        f"({one_line(error).rstrip('.')})."
    )


async def blocking(
    fn: Callable[[], T],
    seconds: float,
    *,
    what: str,
    store: str,
    abandoned: Callable[[T], None] | None = None,
    store_op: bool = True,
) -> T:
    """``fn()`` on a thread of its own, given up after ``seconds`` (rules 1, 2).
    ``store_op``: ``fn`` talks to the store (its errors are the store's).

    Raises:
        StoreTrouble: ``seconds`` passed first, or the store failed under ``fn``; the
            message names ``what`` and ``store``.
    """
    future = start_thread(fn, name=f"weights: {what}")
    try:
        with anyio.move_on_after(min(seconds, _DAY)):
            return await future
    except GangError:
        raise
    except Exception as error:
        if not store_op:
            raise
        raise store_trouble(what, store, error) from error
    except BaseException:  # cancelled
        _hand_over(future, abandoned)
        raise
    _hand_over(future, abandoned)
    raise StoreTrouble(
        f"The weights channel gave up on {what} after {seconds:.1f} s: the store at "
        f"{store} did not answer (stopped, or this process cut off from it)."
    )


def _hand_over(future: Future[T], abandoned: Callable[[T], None] | None) -> None:
    """Hands what a call given up on returns, once it does, to ``abandoned`` (rule 2)."""
    if abandoned is None:
        return
    take = abandoned

    def hand_over() -> None:
        if future.exception() is None:
            take(future.result())

    add_done_callback(future, hand_over)


def run_sync(fn: Callable[[], Any]) -> Any:
    """Runs the coroutine function ``fn`` to its end on an event loop of this thread."""
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return anyio.run(fn)
    raise RuntimeError(
        "The *_sync methods are for code without a running event loop: await instead."
    )
