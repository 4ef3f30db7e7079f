"""Room under a gang's in-flight bounds: refusing, blocking, and awaiting it.

Rules:
1. Room is judged under the gang's lock by the scheduler's ``is_full(num_bytes)``,
   which counts every admitted op, started or queued.
2. ``when_full="raise"`` refuses at once; ``"block"`` waits on a condition of the
   gang's lock, never on an event loop's thread (it would stop the loop that frees the
   room); both before the op is numbered, so a refused call changes nothing.
3. ``wait_for_room`` is the awaitable form, for a task that issues in a loop: a waiter
   is a future, so it can be awaited on every async backend.
4. Whenever an op leaves the gang, and when the gang breaks or closes, every blocked
   thread and every waiter is woken, and looks again; a gang that is no longer usable
   raises its own error then.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import anyio.lowlevel

from agang._errors import GangError, GangFullError
from agang._policy import InFlightLimits
from agang._runtime import loops
from agang._runtime.future import Future

_NO_WAITERS: list[Future[None]] = []  # returned, never changed: callers only iterate


class Room:
    """The waiting for room of one gang; the gang calls it holding its own lock."""

    def __init__(
        self,
        lock: threading.RLock,
        is_full: Callable[[int], bool],
        check_usable: Callable[[], None],
        limits: InFlightLimits,
        gang_name: str,
    ) -> None:
        self._lock = lock
        self._is_full = is_full
        self._check_usable = check_usable
        self._limits = limits
        self._gang_name = gang_name
        self._condition = threading.Condition(lock)
        self._num_blocked = 0
        self._waiters: list[Future[None]] = []

    def wait_or_refuse(self, op: str, num_bytes: int, seconds: float | None) -> None:
        """Returns once an op of ``num_bytes`` fits, or refuses it (rule 2).

        The caller holds the lock; ``seconds`` bounds the wait of ``"block"``.
        """
        if self._limits.when_full == "queue" or not self._is_full(num_bytes):
            return
        bounds = f"{self._limits.max_ops} ops, {self._limits.max_bytes} bytes"
        if self._limits.when_full == "raise":
            raise GangFullError(
                f"`{op}` on gang '{self._gang_name}' was refused: the gang is at its "
                f"in-flight bound ({bounds}) and its policy is when_full='raise'. Await "
                f"earlier ops first, or use when_full='queue'."
            )
        if loops.current_library() is not None:
            raise RuntimeError(
                f"`{op}` on gang '{self._gang_name}' would block the event loop: the gang "
                f"is at its in-flight bound and its policy is when_full='block'. Use "
                f"'queue' on an event loop."
            )
        stop_at = None if seconds is None else time.monotonic() + seconds
        self._num_blocked += 1
        try:
            while self._is_full(num_bytes):
                self._check_usable()
                left = None if stop_at is None else stop_at - time.monotonic()
                if left is not None and left <= 0:
                    raise GangFullError(
                        f"`{op}` on gang '{self._gang_name}' waited {seconds:g} s for room "
                        f"under the gang's in-flight bound ({bounds}) in vain."
                    )
                self._condition.wait(left)
            self._check_usable()
        finally:
            self._num_blocked -= 1

    async def wait(self, num_bytes: int) -> None:
        """Waits until an op of ``num_bytes`` fits (rule 3); always a checkpoint."""
        while True:
            with self._lock:
                self._check_usable()
                if not self._is_full(num_bytes):
                    break
                waiter: Future[None] = Future("wait_for_room")
                self._waiters.append(waiter)
            # Woken when room may have freed, or the gang broke or closed: the next pass
            # then raises the gang's own error (rule 4).
            with contextlib.suppress(GangError):
                await waiter
        await anyio.lowlevel.checkpoint()

    def wake(self) -> list[Future[None]]:
        """Wakes the blocked threads; returns the waiters, for the caller to finish
        outside the lock (rule 4). The caller holds the lock. Runs for every finished op,
        so with nobody waiting (the usual case) it allocates nothing."""
        if self._num_blocked:
            self._condition.notify_all()
        if not self._waiters:
            return _NO_WAITERS
        waiters, self._waiters = self._waiters, []
        return waiters
