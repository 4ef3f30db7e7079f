"""The handle a collective returns: issued already, complete when awaited.

Rules:
1. A handle finishes exactly once, with a value or an error; the first finisher wins
   (c10d completion, the deadline, a close or a break of the gang) and later ones are
   ignored. Finishing may happen on any thread.
2. Finishing runs the registered callbacks once, outside the lock, on the finishing
   thread. Callbacks only hand the news on (to a loop, a thread event); they never block.
3. Waiting never changes the op: a cancelled or timed-out wait leaves the op running
   and its tensors busy until c10d is done with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar, final

from agang._validate import check_timeout
from agang._wakeup import wait_async

T = TypeVar("T")

_PENDING = 0
_FINISHING = 1  # the outcome is set; the gang reacts to it before any waiter may see it
_DONE = 2


@final
class Handle(Generic[T]):
    """An issued collective. ``await`` it (or call :meth:`wait`) for its output.

    The op was handed to the backend when the gang's method returned this handle, so
    work placed between the call and the ``await`` overlaps the communication.

    Example:
        >>> handle = gang.all_reduce(grad)
        >>> loss = compute_something_else()
        >>> grad = await handle
    """

    __slots__ = (
        "_before_wait",
        "_callbacks",
        "_error",
        "_finished_at",
        "_hold",
        "_lock",
        "_observer",
        "_state",
        "_value",
        "issued_at",
        "num_bytes",
        "op",
        "seq",
        "timeout",
    )

    def __init__(self, *, op: str, seq: int, num_bytes: int, timeout: float | None) -> None:
        #: The collective's name, e.g. ``"all_reduce"``.
        self.op = op
        #: This op's sequence number on its gang; equal on every rank for the same op.
        self.seq = seq
        #: Bytes this rank sends or receives (the size of its tensors).
        self.num_bytes = num_bytes
        #: The deadline in seconds from :attr:`issued_at`, or None for none.
        self.timeout = timeout
        #: ``time.monotonic()`` when the op was issued.
        self.issued_at = time.monotonic()
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._finished_at: float | None = None
        self._callbacks: list[Callable[[], None]] = []
        # Why waiting now would never end (the op is held in an open coalesce scope).
        self._hold: str | None = None
        # Told how long the loop took to resume the waiter after the op finished.
        self._observer: Callable[[float], None] | None = None
        # Called when a waiter starts on the pending op (its gang re-arms a lost deadline).
        self._before_wait: Callable[[], None] | None = None

    def __str__(self) -> str:
        if self.seq < 0:  # held in a coalesce scope, numbered when it ends
            return f"`{self.op}` (not yet numbered)"
        return f"`{self.op}` (seq {self.seq})"

    def __repr__(self) -> str:
        state = "pending" if self._state != _DONE else ("failed" if self._error else "done")
        return f"<agang.Handle {self.op} seq={self.seq} bytes={self.num_bytes} {state}>"

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        self._check_not_held()
        if self._before_wait is not None and self._state != _DONE:
            self._before_wait()
        await wait_async(self)
        return self.result()

    def done(self) -> bool:
        """Returns True once the op finished, successfully or not."""
        return self._state == _DONE

    def _settled(self) -> bool:
        """Whether the outcome is set, even if waiters are not yet told (the gang's view)."""
        return self._state != _PENDING

    @property
    def elapsed(self) -> float | None:
        """Seconds from issue to finish, or None while pending."""
        if self._finished_at is None:
            return None
        return self._finished_at - self.issued_at

    def result(self) -> T:
        """Returns the output of a finished op, or raises its error.

        Raises:
            asyncio.InvalidStateError: The op has not finished yet; await it or call
                :meth:`wait` instead.
        """
        if self._state != _DONE:
            raise asyncio.InvalidStateError(
                f"{self.op} (seq {self.seq}) has not finished yet; await it or call wait()."
            )
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]

    def exception(self) -> BaseException | None:
        """Returns the error of a finished op, or None if it succeeded.

        Raises:
            asyncio.InvalidStateError: The op has not finished yet.
        """
        if self._state != _DONE:
            raise asyncio.InvalidStateError(
                f"{self.op} (seq {self.seq}) has not finished yet; await it or call wait()."
            )
        return self._error

    def wait(self, timeout: float | None = None) -> T:
        """Blocks the calling thread until the op finishes, and returns its output.

        For synchronous code. On an event loop's thread, ``await`` the handle instead:
        this call would stop the loop (and a deadline the loop drives) while it waits.

        Args:
            timeout: Seconds to wait at most, or None. This bounds the *wait*, not the
                op: when it passes the op keeps running and its tensors stay busy.

        Returns:
            The op's output, as ``await`` would return it.

        Raises:
            TimeoutError: ``timeout`` passed before the op finished.
            GangError: The op failed; see :meth:`result`.

        Example:
            >>> out = gang.all_reduce(t).wait()
        """
        seconds = check_timeout(timeout)
        self._check_not_held()
        if self._state != _DONE:
            if self._before_wait is not None:
                self._before_wait()
            # A bare lock, released by the finisher: cheaper than threading.Event.
            signal = threading.Lock()
            signal.acquire()
            self._add_done_callback(signal.release)
            if not signal.acquire(timeout=-1 if seconds is None else seconds):
                self._remove_done_callback(signal.release)
                raise TimeoutError(
                    f"`wait` gave up on {self.op} (seq {self.seq}) after {seconds:g} s; "
                    f"the op itself is still running."
                )
        return self.result()

    # Internal: used by the gangs and the wake-up bridge.

    def _check_not_held(self) -> None:
        hold = self._hold
        if hold is not None and self._state != _DONE:
            raise RuntimeError(hold)

    def _finish(
        self, value: Any, error: BaseException | None, *, then: Callable[[], None] | None = None
    ) -> bool:
        """Finishes the handle, unless it already is; returns whether this call did.

        ``then`` runs once the outcome is set but before :meth:`done` turns True or any
        waiter is woken, so that what it changes (the gang broken, counters) is seen by a
        waiter on another thread that finds the handle done and calls again at once.
        """
        with self._lock:
            if self._state != _PENDING:
                return False
            self._value = value
            self._error = error
            self._finished_at = time.monotonic()
            if then is None:
                self._state = _DONE
                callbacks, self._callbacks = self._callbacks, []
            else:
                self._state = _FINISHING
        if then is None:
            for callback in callbacks:
                callback()
            return True
        try:
            then()
        finally:
            with self._lock:
                self._state = _DONE
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback()
        return True

    def _add_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._state != _DONE:
                self._callbacks.append(callback)
                return
        callback()

    def _remove_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)


def finish_all(outcomes: Iterable[tuple[Handle[Any], Any]], error: BaseException | None) -> None:
    """Finishes many handles (a flat op's members) like ``_finish`` without ``then``,
    with one timestamp and without a call per handle: it runs for every member."""
    now = time.monotonic()
    for handle, value in outcomes:
        with handle._lock:
            if handle._state != _PENDING:
                continue
            handle._value = value
            handle._error = error
            handle._finished_at = now
            handle._state = _DONE
            callbacks, handle._callbacks = handle._callbacks, []
        for callback in callbacks:
            callback()
