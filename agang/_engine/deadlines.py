"""Deadlines: one timer per gang, and what happens when it finds an op late.

The engine's rule 5, in full, in two halves. A timer (``Alarm``) runs one gang's
deadline check at a given time, without a thread or task per op; the check
(``Expiry``) finds the ops that are late, asks the peers where they stand, and fails the
late handles with ``GangTimeoutError``. The expiry talks to its engine through the small
``Expiring`` interface defined here, so this module does not know the engine's class.

The timer. Each gang keeps at most one pending check: armed for the earliest deadline of
its in-flight ops, it expires what is due and re-arms itself. So the number of timers is
per gang, not per op, and a million ops with a 30 s default cost nothing extra until
something is really late. Where the check runs (the *driver*):
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

The expiry. The ops found late are failed once the backend's blame (``start_blame``) has
said, per peer, whether it issued the op, is waiting on it, or gave no answer:
3. *One question per batch.* The ops found late at one check share one blame, asked
   about the oldest of them; a check that finds more while a blame is out adds them to
   it. A thousand ops timing out together cost one round of questions, not a thousand.
   A collective is asked about by its number among the gang's collectives, the same op
   on every rank; a point-to-point op by its sequence number, which is the same op on
   its peer only where the two ranks' earlier ops were (``reports``' rule 4).
4. *Bounded.* The backend answers within its blame bound whatever the peers do, so a
   timeout is raised at most that much after its deadline; the answer costs nothing
   before a deadline passes (the peers read their own state only when asked).
5. *Once.* A handle already finished (its op ended while the peers were asked) is not
   failed again; ``on_timeout="abort"`` breaks the gang after the first expiry.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from agang._backends.contract import Backend, Progress
from agang._engine import reports
from agang._engine.scheduler import Entry
from agang._errors import OpContext
from agang._handle import Handle
from agang._policy import GangPolicy
from agang._runtime import fork, loops, threads
from agang._runtime.future import finish

log = logging.getLogger("agang.engine")


_running_loop = asyncio._get_running_loop


def current_driver() -> object:
    """The running asyncio loop of this thread, or None for the timer thread."""
    return loops.asyncio_loop()


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
        if loops.asyncio_loop() is loop:
            timer.cancel()
        elif alive(loop):  # TimerHandle.cancel is not thread-safe
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(timer.cancel)

    return cancel


class Alarm:
    """The one pending deadline check of a gang, armed for a time on a driver.

    Arming for a later time than the pending check's is a no-op; arming for an earlier
    one, or when the pending check's driver is gone, replaces (and cancels) it.
    ``fire(armed_for, driver)`` runs when the time comes. ``lock`` is the gang's.
    """

    def __init__(self, lock: threading.RLock, fire: Callable[[float, object], None]) -> None:
        self._lock = lock
        self._fire = fire
        self._armed_at: float | None = None
        self._driver: object = None
        self._cancel: Cancel | None = None

    def arm(self, due: float) -> None:
        driver = _running_loop()  # current_driver(), without two calls: arming is per op
        # The usual case, read without the lock: armed already, no later than ``due``,
        # on this thread's running loop (or the timer thread), which is alive since it
        # runs this. A check that fires meanwhile re-arms for the ops left, ``due``'s
        # among them: it was admitted before this call.
        armed_at = self._armed_at
        if armed_at is not None and armed_at <= due and self._driver is driver:
            return
        with self._lock:
            if (
                self._armed_at is not None
                and self._armed_at <= due
                and self._driver is driver
                and alive(driver)
            ):
                return
            replaced, self._cancel = self._cancel, None
            self._armed_at = due
            self._driver = driver
        if replaced is not None:
            replaced()
        cancel = call_at(driver, due, lambda: self._fire(due, driver))
        with self._lock:
            if self._armed_at == due and self._driver is driver:
                self._cancel = cancel

    def disarm(self) -> None:
        """Cancels the pending check for good (the gang closed): its callback, which
        holds the gang's engine and, through a stored error's traceback, the failed ops'
        frames and c10d works, is let go at once instead of at the latest deadline."""
        with self._lock:
            cancel, self._cancel = self._cancel, None
            self._armed_at = None
            self._driver = None
        if cancel is not None:
            cancel()

    def disarm_if_lost(self) -> bool:
        """Forgets a check whose driver is gone (an asyncio loop that closed); returns
        whether it did, so that the caller arms it again where it runs."""
        if not self._lost():  # the common case, without the lock
            return False
        with self._lock:
            if not self._lost():  # another thread re-armed it meanwhile
                return False
            self._armed_at = None
            self._cancel = None
            return True

    def _lost(self) -> bool:
        return self._armed_at is not None and not alive(self._driver)

    def fired(self, armed_for: float) -> bool:
        """Marks the check armed for ``armed_for`` as run, if it is still the pending
        one (the caller holds the lock); returns whether it was."""
        if self._armed_at != armed_for:
            return False
        self._armed_at = None
        self._cancel = None
        return True


class _TimerThread:
    """One daemon thread running callbacks at their times, in time order."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        # (when, tie-breaker, [callback]): a cancelled entry's callback is None.
        self._heap: list[tuple[float, int, list[Callable[[], None] | None]]] = []
        self._counter = itertools.count()
        self._stopped = False
        threads.start_daemon(self._run, name="agang-deadlines")

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


def _stop_timer() -> None:
    with _timer_lock:
        timer = _timer
    if timer is not None:
        timer.stop()


def _forget_in_child() -> None:
    # The timer's thread is the parent's (``agang._runtime.fork``): a child's gang needs its own.
    global _timer_lock, _timer
    _timer_lock = threading.Lock()
    _timer = None


threads.at_exit(stop=_stop_timer)
fork.on_fork_in_child(_forget_in_child)


def _timer_thread() -> _TimerThread:
    global _timer
    with _timer_lock:
        if _timer is None:
            _timer = _TimerThread()
        return _timer


class Expiring(Protocol):
    """What the expiry needs of the engine whose deadlines it checks."""

    name: str
    policy: GangPolicy
    backend: Backend

    def reap(self, now: float) -> float | None:
        """Learns, outside the gang's lock, of ops that ended where the backend must be
        asked, and parks those running too long; when to look again, or None."""

    def late(self, now: float, lag: float | None) -> tuple[list[Entry], float | None]:
        """Records the timer's ``lag`` (None: not the loop's), and returns the ops due at
        ``now`` (each once) and the next deadline after them; under the gang's lock."""

    def report_in_flight(self, now: float, skip: int) -> tuple[list[str], list[str]]:
        """The ops in flight but ``skip``, and the recent ones, as a timeout reports them."""

    def context(self, op: str, seq: int, timeout: float | None) -> OpContext:
        """The op's identity, for its error."""

    def is_ordered_only(self, seq: int) -> bool:
        """Whether the op's handle finished once it was ordered (it is still in flight)."""

    def count_timed_out(self) -> None:
        """Counts one op timed out."""

    def break_gang(self, cause: BaseException) -> None:
        """Breaks the gang with ``cause`` (``on_timeout="abort"``)."""


class Expiry:
    """The deadline check of one gang (rules 3-5), and its timer: ``alarm`` runs
    ``check`` when the earliest deadline comes. ``lock`` is the gang's."""

    def __init__(self, owner: Expiring, lock: threading.RLock) -> None:
        self._owner = owner
        self._gang_lock = lock
        self._lock = threading.Lock()
        self._batch: list[Entry] | None = None  # late ops waiting on the blame that is out
        self.alarm = Alarm(lock, self.check)

    def check(self, armed_for: float, driver: object) -> None:
        """The alarm's callback: finds the late ops and asks about them (rule 3)."""
        owner = self._owner
        now = time.monotonic()
        look_again = owner.reap(now)  # ops that ended are not late
        with self._gang_lock:
            # The loop ran this timer late by however long it was busy or blocked.
            fired = self.alarm.fired(armed_for) and driver is not None
            due, following = owner.late(now, max(0.0, now - armed_for) if fired else None)
        if look_again is not None and (following is None or look_again < following):
            following = look_again
        if following is not None:
            self.alarm.arm(following)
        if not due:
            return
        with self._lock:
            if self._batch is not None:
                self._batch.extend(due)
                return
            self._batch = list(due)
        asked, asked_op, collective = due[0].seq, due[0].op, due[0].collective
        call = reports.call_of(due[0].fingerprint)  # compared with the peers' (reports rule 5)
        try:
            owner.backend.start_blame(
                asked if collective < 0 else collective,
                lambda peers, note: self._blamed(asked, asked_op, peers, note, call),
                collective=collective >= 0,
            )
        except Exception as exc:  # the question never left: fail the ops without answers
            log.debug("Gang '%s' could not ask its peers.", owner.name, exc_info=True)
            self._blamed(asked, asked_op, None, f"asking failed: {exc}", call)

    def _blamed(
        self,
        asked: int,
        asked_op: str,
        peers: Mapping[int, Progress | None] | None,
        note: str,
        call: str | None = None,
    ) -> None:
        with self._lock:
            batch, self._batch = self._batch or [], None
        for entry in batch:
            handle, _ = entry.item
            index = entry.check_index if not entry.ready else None
            self.expire(
                handle,
                asked=asked,
                asked_op=asked_op,
                peers=peers,
                note=note,
                index=index,
                call=call,  # every entry is told about op `asked`, as `asked_op` says
            )

    def expire(
        self,
        handle: Handle[Any],
        *,
        asked: int,
        asked_op: str | None = None,
        peers: Mapping[int, Progress | None] | None,
        note: str,
        index: int | None,
        call: str | None = None,
    ) -> None:
        """Fails ``handle`` with a ``GangTimeoutError`` naming what the peers said about
        op ``asked`` (this rank's ``asked_op``, called as ``call``)."""
        owner = self._owner
        now = time.monotonic()
        in_flight, recent = owner.report_in_flight(now, handle.seq)
        abort = owner.policy.on_timeout == "abort"
        where = owner.backend.where
        if peers is None:
            blamed = f"The peers could not be asked where they stand: {note}."
        else:
            blamed = reports.describe(peers, where, asked_op, call)
            if asked != handle.seq and blamed:
                blamed = f"{blamed[:-1]} (asked about #{asked}, the oldest late op)."
        error = reports.timed_out(
            owner.context(handle.op, handle.seq, handle.timeout),
            elapsed=now - handle.issued_at,
            in_flight=in_flight,
            recent=recent,
            abort=abort,
            index=index,
            absent=None if peers is None else reports.absent(peers),
            out_of_step=[] if peers is None else reports.out_of_step(peers, asked_op),
            blamed=blamed,
            peers=dict(peers) if peers is not None else None,
            asked_op=asked_op,
            disagree=[] if peers is None else reports.disagreeing(peers, asked_op, call),
            asked_call=call,
        )

        def count_timed_out() -> None:
            owner.count_timed_out()
            if abort:
                owner.break_gang(error)

        if owner.is_ordered_only(handle.seq):
            # Its handle succeeded once ordered; the op itself is late.
            log.error("%s", error)
            count_timed_out()
            return
        # Broken before the waiters wake: their next call must be refused (the engine's rule 6).
        finish(handle, None, error, then=count_timed_out)
