"""A one-shot result that any thread may set and any loop or thread may wait for.

The gang's internal waits (room under the in-flight bounds, a blocking call run on a
thread, a lane being made) are futures; an op's [`agang.Handle`][agang.Handle] is a future with
the op's metadata. Neither is an ``asyncio.Future``: they finish on backend threads and
are awaited from asyncio, uvloop and trio alike.

Rules:
1. A future finishes exactly once, with a value or an error; the first finisher wins
   and later ones are ignored. Finishing may happen on any thread.
2. Finishing runs the registered callbacks once, outside the lock, on the finishing
   thread. Callbacks only hand the news on (to a loop, a thread event); they never block.
3. Waiting never changes what is awaited: a cancelled or timed-out wait leaves the work
   running.

The package drives futures through this module's functions, not methods, so that they
stay off the public ``Handle``: ``finish`` (rule 1, with an optional ``then`` for what
must change before any waiter wakes), ``finish_at`` (many at one timestamp),
``finish_unseen`` (one that nobody has seen yet), ``add_done_callback`` and
``remove_done_callback`` (rule 2), ``settled`` (the outcome is set, waiters maybe not yet
told), ``error_of`` (the error set, before the waiters are told) and ``pending`` (a new
one of a subclass, without its constructor). The methods behind them keep a private name
and are the future's own: code elsewhere calls the functions, which cost what the
methods cost.

Waiting on an event loop (``wait_async``): the task awaiting a future lives on an
asyncio, uvloop or trio loop, while the future finishes on a backend thread (Gloo's
worker, the CUDA watcher, the deadline timer). The callback only schedules a wake-up with
the loop's thread-safe entry point, never touches the loop's state itself, and swallows
the error a closed loop raises: once the loop is gone there is nobody left to wake.
Cancelling the awaiting task removes the callback and leaves the work running (rule 3).

A future may finish with a ``Deferred`` value: the work of turning the op's buffers
into the value (decoding received objects) then runs on the thread that takes the result,
once, instead of on the thread that finished the future (c10d's, which must not be held).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from agang._runtime import handoffs, loops
from agang._validate import check_timeout

T = TypeVar("T")
F = TypeVar("F", bound="Future[Any]")

_PENDING = 0
_FINISHING = 1  # the outcome is set; its owner reacts to it before any waiter may see it
_DONE = 2


class Deferred:
    """A value computed on first ``take``, by the taker's thread; its error is kept.

    Args:
        compute: Makes the value; called at most once.
    """

    __slots__ = ("_compute", "_error", "_lock", "_value")

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._lock = threading.Lock()
        self._value: Any = None
        self._error: Exception | None = None

    def take(self) -> Any:
        with self._lock:
            compute, self._compute = self._compute, None
            if compute is not None:
                try:
                    self._value = compute()
                except Exception as exc:
                    self._error = exc
        if self._error is not None:
            raise self._error
        return self._value


class Future(Generic[T]):
    """An internal one-shot result, awaitable on every async backend.

    Args:
        what: What is awaited, for messages (``"wait_for_room"``, ``"init"``).
    """

    __slots__ = ("_callbacks", "_error", "_finished_at", "_lock", "_state", "_value", "what")

    def __init__(self, what: str) -> None:
        self.what = what
        self._lock = threading.Lock()
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._finished_at: float | None = None
        self._callbacks: list[Callable[[], None]] = []

    def __str__(self) -> str:
        return f"`{self.what}`"

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        await wait_async(self)
        return self.result()

    def done(self) -> bool:
        """Returns True once finished, successfully or not."""
        return self._state == _DONE

    def _settled(self) -> bool:
        """Whether the outcome is set, even if waiters are not yet told."""
        return self._state != _PENDING

    def result(self) -> T:
        """Returns the value, or raises the error, of a finished future.

        Raises:
            asyncio.InvalidStateError: It has not finished yet; await it or call
                ``wait`` instead.
        """
        if self._state != _DONE:
            raise asyncio.InvalidStateError(
                f"{self} has not finished yet; await it or call wait()."
            )
        if self._error is not None:
            raise self._error
        if type(self._value) is Deferred:
            return self._value.take()  # type: ignore[no-any-return]
        return self._value  # type: ignore[no-any-return]

    def exception(self) -> BaseException | None:
        """Returns the error of a finished future, or None if it succeeded.

        Raises:
            asyncio.InvalidStateError: It has not finished yet.
        """
        if self._state != _DONE:
            raise asyncio.InvalidStateError(
                f"{self} has not finished yet; await it or call wait()."
            )
        if self._error is None and type(self._value) is Deferred:
            try:
                self._value.take()
            except Exception as exc:
                return exc
        return self._error

    def wait(self, timeout: float | None = None) -> T:
        """Blocks the calling thread until finished, and returns the value.

        Args:
            timeout: Seconds to wait at most, or None. This bounds the *wait*, not the
                work awaited: when it passes, the work goes on.

        Raises:
            TimeoutError: ``timeout`` passed first.
        """
        seconds = check_timeout(timeout)
        if self._state != _DONE:
            self._block(seconds)
        return self.result()

    def _block(self, seconds: float | None) -> None:
        # A bare lock, released by the finisher: cheaper than threading.Event.
        signal = threading.Lock()
        signal.acquire()
        self._add_done_callback(signal.release)
        if not signal.acquire(timeout=-1 if seconds is None else seconds):
            self._remove_done_callback(signal.release)
            raise TimeoutError(
                f"`wait` gave up on {self} after {seconds:g} s; it is still running."
            )

    def _finish(
        self, value: Any, error: BaseException | None, *, then: Callable[[], None] | None = None
    ) -> bool:
        """Finishes, unless already finished; returns whether this call did (rule 1).

        ``then`` runs once the outcome is set but before ``done`` turns True or any
        waiter is woken, so that what it changes (a gang broken, counters) is seen by a
        waiter on another thread that finds the future done and calls again at once.
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

    def _finish_at(self, value: Any, error: BaseException | None, now: float) -> None:
        """``_finish`` without ``then``, with a timestamp shared by many (a flat op's
        members finish together)."""
        with self._lock:
            if self._state != _PENDING:
                return
            self._value = value
            self._error = error
            self._finished_at = now
            self._state = _DONE
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def _finish_unseen(self, value: Any, now: float) -> None:
        """Finishes, at ``now``, a future nobody has seen yet (an op's handle, its op
        ended inside the call that issues it): nobody waits on it and it has no
        callbacks, so the lock and the wake-ups have nothing to guard."""
        self._value = value
        self._finished_at = now
        self._state = _DONE

    def _add_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._state != _DONE:
                self._callbacks.append(callback)
                return
        callback()

    def _remove_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)


# The finishing side of a future (see the module's docstring), for the code that finishes
# one (engines, waiters, threads) and never a method of the public ``Handle``: each is the
# method itself, so calling it costs no more than the method would.
finish = Future._finish
finish_at = Future._finish_at
finish_unseen = Future._finish_unseen
add_done_callback = Future._add_done_callback
remove_done_callback = Future._remove_done_callback
settled = Future._settled


def pending(cls: type[F], what: str) -> F:
    """A pending future of class ``cls`` (a subclass), as ``Future(what)`` makes one but
    without calling ``cls.__init__``: where a subclass makes one per op (``Handle``: the
    engine's ``issued``), a chain of constructor calls costs a share of issuing it."""
    future = _new_object(cls)
    future.what = what
    future._lock = threading.Lock()
    future._state = _PENDING
    future._value = None
    future._error = None
    future._finished_at = None
    future._callbacks = []
    return future


_new_object = object.__new__


def error_of(future: Future[Any]) -> BaseException | None:
    """The error ``future`` finished with, or is finishing with (its ``then`` running);
    None while pending or for a success. Unlike ``Future.exception``, never raises."""
    return future._error


def finished(what: str, value: Any = None, error: BaseException | None = None) -> Future[Any]:
    """A future that has already finished."""
    future: Future[Any] = Future(what)
    future._finish(value, error)
    return future


class _Parked(threading.local):
    """The waiters parked on this thread's loop, and the awaits in a row that found
    their future finished and let no other task run (``READY_STREAK``)."""

    count = 0
    ready = 0


_parked = _Parked()

#: How many awaits in a row, on one thread's loop, may find their future finished and
#: return without a pass of the loop. Every other one takes a pass (a checkpoint: other
#: ready tasks run, and a cancellation is seen), so a loop of awaits on ops that end at
#: once (a fast device, a fake gang) still lets the loop's other tasks run, after at most
#: this many; cooperative budgets as tokio's do the same. A pass costs about 3 us on
#: asyncio, more than the rest of such an await.
READY_STREAK = 16


def num_parked() -> int:
    """The number of tasks parked on this thread's loop, waiting for a future."""
    return _parked.count


def passed_loop() -> None:
    """The current task has just let the loop run its other tasks (a checkpoint):
    the next awaits of finished futures need not (``READY_STREAK``)."""
    _parked.ready = 0


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def wait_async(future: Future[Any]) -> bool:
    """Suspends the current task until ``future`` finishes.

    A future not finished yet suspends the task, a checkpoint. One already finished
    returns at once, unless ``READY_STREAK`` awaits in a row on this thread did so:
    then it takes one pass of the loop.

    Returns:
        Whether the task had to wait (the future was not finished yet).
    """
    if future._state == _DONE:
        parked = _parked
        if parked.ready < READY_STREAK:
            parked.ready += 1
            return False
        parked.ready = 0
        await loops.checkpoint()
        return False
    loop = loops.asyncio_loop()
    if loop is not None:
        return await _wait_asyncio(future, loop)
    return await _wait_trio(future)


async def _wait_asyncio(future: Future[Any], loop: asyncio.AbstractEventLoop) -> bool:
    woken: asyncio.Future[None] = loop.create_future()
    here = threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == here:  # finished on the loop's own thread
            loop.call_soon(_resolve, woken)
            return
        handoffs.count_handoff()
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve, woken)

    future._add_done_callback(wake)
    _parked.count += 1
    try:
        await woken
    finally:
        _parked.count -= 1
        _parked.ready = 0
        future._remove_done_callback(wake)
    return True


async def _wait_trio(future: Future[Any]) -> bool:
    token = loops.trio_token()
    if token is None:
        raise RuntimeError("An agang handle must be awaited from asyncio, uvloop or trio.")
    import trio

    event = trio.Event()
    here = threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == here:  # finished on the run's own thread
            event.set()
            return
        handoffs.count_handoff()
        # A finished run raises RunFinishedError: nobody is waiting any more.
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(event.set)

    future._add_done_callback(wake)
    _parked.count += 1
    try:
        await event.wait()
    finally:
        _parked.count -= 1
        _parked.ready = 0
        future._remove_done_callback(wake)
    return True
