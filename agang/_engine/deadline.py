"""Running a gang's deadline check at a given time, without a thread or task per op.

Each gang keeps at most one pending check (see ``engine``): armed for the earliest
deadline of its in-flight ops, it expires what is due and re-arms itself. So the number
of timers is per gang, not per op, and a million ops with a 30 s default cost nothing
extra until something is really late.

Where the check runs (the *driver*):
1. An op issued on an asyncio (or uvloop) loop arms the check on that loop with
   ``call_later``: the loop drives it, on its own clock (asyncio's is monotonic).
2. Anything else (trio, synchronous callers, other threads) uses one process-wide timer
   thread, started on first use. trio has no ``call_at``, and a system task per gang
   would tie the gang to one ``trio.run``; the thread is shared by all gangs.
A gang re-arms on the current driver when the one it armed has closed: when it arms
again (a new op), and when a waiter starts on one of its ops (a synchronous ``wait`` or
an ``await`` elsewhere after the ``asyncio.run`` that issued it has ended), so a check is
never lost with a finished loop. Re-arming cancels the check it replaces, so a gang has
one pending check, not one per re-arm. All times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from agang import _asynclib, _exit

log = logging.getLogger("agang")


def current_driver() -> object:
    """The running asyncio loop of this thread, or None for the timer thread."""
    return _asynclib.asyncio_loop()


def alive(driver: object) -> bool:
    if isinstance(driver, asyncio.AbstractEventLoop):
        return not driver.is_closed() and driver.is_running()
    return True


Cancel = Callable[[], None]


def call_at(driver: object, when: float, callback: Callable[[], None]) -> Cancel:
    """Runs ``callback`` at monotonic time ``when`` on ``driver``.

    Returns:
        A function that cancels the call, from any thread; harmless once it has run.
    """
    if isinstance(driver, asyncio.AbstractEventLoop) and alive(driver):
        return _cancel_on(driver, driver.call_later(max(0.0, when - time.monotonic()), callback))
    return _timer_thread().call_at(when, callback)


def _cancel_on(loop: asyncio.AbstractEventLoop, timer: asyncio.TimerHandle) -> Cancel:
    def cancel() -> None:
        if _asynclib.asyncio_loop() is loop:
            timer.cancel()
        elif alive(loop):  # TimerHandle.cancel is not thread-safe
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(timer.cancel)

    return cancel


class _TimerThread:
    """One daemon thread running callbacks at their times, in time order."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        # (when, tie-breaker, [callback]): a cancelled entry's callback is None.
        self._heap: list[tuple[float, int, list[Callable[[], None] | None]]] = []
        self._counter = itertools.count()
        self._stopped = False
        _exit.start_daemon(self._run, name="agang-deadlines")
        _exit.add_stopper(self.stop)

    def call_at(self, when: float, callback: Callable[[], None]) -> Cancel:
        slot: list[Callable[[], None] | None] = [callback]
        with self._condition:
            heapq.heappush(self._heap, (when, next(self._counter), slot))
            self._condition.notify()

        def cancel() -> None:
            slot[0] = None  # popped and skipped when due

        return cancel

    def stop(self) -> None:
        """Ends the thread (at exit); deadlines not yet due are dropped."""
        with self._condition:
            self._stopped = True
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._condition.wait(delay)
                if self._stopped:
                    return
                _, _, (callback,) = heapq.heappop(self._heap)
            if callback is None:
                continue
            try:
                callback()
            except Exception:  # pragma: no cover - callbacks catch their own errors
                log.exception("A deadline check failed.")
            del callback  # what it holds is freed now, not while the thread waits


_timer_lock = threading.Lock()
_timer: _TimerThread | None = None


def _timer_thread() -> _TimerThread:
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = _TimerThread()
        return _timer
