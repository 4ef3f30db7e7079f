"""Running a blocking call (c10d set-up, destroy, store waits) off the event loop.

Each call gets its own daemon thread: these calls are rare (init, create_gang, close),
and a daemon thread stuck in c10d can never keep the process from exiting, which a
pooled non-daemon worker could (at exit ``_exit`` joins the ones that may touch the
user's objects, within a bound). The caller awaits a future the thread finishes, so the
wait is cancellable on every backend; a cancelled or timed-out call leaves its thread to
end on its own (c10d gets a bounded timeout of its own from the caller).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from agang._runtime import exit as _exit
from agang._runtime.future import Future

T = TypeVar("T")

log = logging.getLogger("agang")


def start_thread(fn: Callable[[], T], *, name: str, join_at_exit: bool = True) -> Future[T]:
    """Runs ``fn`` on a new daemon thread; the future finishes with its result.

    ``join_at_exit=False`` only for a thread that never runs c10d code: one still inside
    c10d when the interpreter ends aborts the process ("terminate called without an
    active exception"), so those are joined at exit, within its bound (``_exit``).
    """
    future: Future[Any] = Future(name)

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            future._finish(None, exc)
        else:
            future._finish(value, None)

    _exit.start_daemon(run, name=f"agang: {name}", join_at_exit=join_at_exit)
    return future


async def run_blocking(
    fn: Callable[[], T], *, name: str, seconds: float | None, join_at_exit: bool = True
) -> T | None:
    """Awaits ``fn()`` run on a daemon thread, giving up after ``seconds``.

    Returns:
        ``fn``'s result, or None if ``seconds`` passed first (the thread is left to end).
    """
    future = start_thread(fn, name=name, join_at_exit=join_at_exit)
    with anyio.move_on_after(seconds):
        return await future
    return None


def run_all(fns: list[Callable[[], None]], *, name: str, max_threads: int = 32) -> None:
    """Runs ``fns`` at once on up to ``max_threads`` daemon threads; returns when all have.

    For teardowns that mostly wait (a Gloo group's destructor waits about 18 ms for its
    threads here): 400 lanes released one by one would take seconds. An error is logged,
    not raised, so one failed release never leaves the others undone.
    """
    if len(fns) <= 1:
        for fn in fns:
            _logged(fn, name)
        return
    pending = list(fns)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                fn = pending.pop()
            _logged(fn, name)

    threads = []
    for _ in range(min(max_threads, len(fns))):
        try:
            threads.append(_exit.start_daemon(work, name=f"agang: {name}", join_at_exit=False))
        except RuntimeError:  # no new threads (interpreter shutting down): go on here
            break
    work()
    for thread in threads:
        thread.join()


def _logged(fn: Callable[[], None], name: str) -> None:
    try:
        fn()
    except Exception:
        log.exception("%s failed.", name)
