"""Running a gang's deadline check at a given time, without a thread or task per op.

Each gang keeps at most one pending check (see ``_base_gang``): armed for the earliest
deadline of its in-flight ops, it expires what is due and re-arms itself. So the number
of timers is per gang, not per op, and a million ops with a 30 s default cost nothing
extra until something is really late.

Where the check runs (the *driver*):
1. An op issued on an asyncio (or uvloop) loop arms the check on that loop with
   ``call_later``: the loop drives it, on its own clock (asyncio's is monotonic).
2. Anything else (trio, synchronous callers, other threads) uses one process-wide timer
   thread, started on first use. trio has no ``call_at``, and a system task per gang
   would tie the gang to one ``trio.run``; the thread is shared by all gangs.
A gang re-arms on the current driver when the one it armed has closed, so a check is
never lost with a finished ``asyncio.run``. All times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("agang")


def current_driver() -> object:
    """The running asyncio loop of this thread, or None for the timer thread."""
    return asyncio._get_running_loop()


def alive(driver: object) -> bool:
    if isinstance(driver, asyncio.AbstractEventLoop):
        return not driver.is_closed() and driver.is_running()
    return True


def call_at(driver: object, when: float, callback: Callable[[], None]) -> None:
    """Runs ``callback`` at monotonic time ``when`` on ``driver``."""
    if isinstance(driver, asyncio.AbstractEventLoop) and alive(driver):
        driver.call_later(max(0.0, when - time.monotonic()), callback)
        return
    _timer_thread().call_at(when, callback)


class _TimerThread:
    """One daemon thread running callbacks at their times, in time order."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._run, name="agang-deadlines", daemon=True)
        self._thread.start()

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        with self._condition:
            heapq.heappush(self._heap, (when, next(self._counter), callback))
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    delay = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._condition.wait(delay)
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # pragma: no cover - callbacks catch their own errors
                log.exception("A deadline check failed.")


_timer_lock = threading.Lock()
_timer: _TimerThread | None = None


def _timer_thread() -> _TimerThread:
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = _TimerThread()
        return _timer
