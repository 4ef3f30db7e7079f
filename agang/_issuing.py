"""The scheduler's driver: numbering, starting, completing, deadlines, breaking, closing.

It feeds the pure core (``_scheduler``) under the gang's lock, starts what the core
hands back, and talks to the backend only through the primitives a gang implements.

Rules:
1. A call checks its input first; a bad call changes nothing, not even the sequence
   number, so ranks stay in step after a caught ``ValueError``.
2. Then it takes a sequence number and marks its tensors busy, atomically, and the op
   is admitted to the core, which starts ops in sequence order (``_scheduler`` rules 1
   and 2). An op that cannot start at once is started later by whichever thread frees
   room for it (a completion, an order check, the gate opening), as if from the caller
   (``_later``). A bounded gang whose policy is ``"raise"`` or ``"block"`` refuses, or
   waits, before numbering.
3. A primitive reports its end once through ``done(error)`` from any thread. Its
   tensors are released then, and only then (c10d may write into them until then).
4. Deadlines are checked by one timer per gang on the issuer's loop (or the timer
   thread), armed for the core's next deadline. When one passes, the handle fails with
   ``GangTimeoutError`` carrying the flight recorder; with ``on_timeout="abort"`` the
   gang then breaks, with ``"raise"`` only that handle fails and its op stays in flight
   (tensors busy) until c10d ends it. An op still in its order check when its deadline
   passes is failed once the gang has asked which ranks never reached that check
   (``_start_census``): the error names them (fault matrix C2: a rank that skipped the
   last op). Asking takes at most a fraction of a second.
5. Any failure of a started op breaks the gang: every pending handle fails with
   ``GangBrokenError`` (the first cause attached), queued ops are dropped unstarted, the
   communicator is aborted, and every later call raises at once without touching c10d.
6. Closing fails pending handles with ``GangClosedError`` at once, then releases the
   backend off the loop.
7. With order checking on, each collective's fingerprint goes to the side channel when
   it is admitted (checks run in admission order, pipelined); the op becomes ready only
   once every rank's fingerprint agreed. A mismatch fails the op with
   ``CollectiveMismatchError`` on every rank and breaks the gang before the op starts.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override

from agang import _busy, _deadline
from agang._errors import (
    CollectiveError,
    CollectiveMismatchError,
    GangBrokenError,
    GangClosedError,
    GangTimeoutError,
    OpContext,
)
from agang._gang import Gang
from agang._handle import Handle
from agang._policy import GangPolicy
from agang._room import Room
from agang._scheduler import Entry, Scheduler
from agang._statistics import Counters, GangStatistics
from agang._validate import check_non_negative_int, check_timeout

log = logging.getLogger("agang")

Done = Callable[[BaseException | None], None]
Start = Callable[[Done], None]
# An order check reports None when every rank agreed, else every rank's fingerprint.
Checked = Callable[[dict[int, str] | None, BaseException | None], None]


def after_post(post: Callable[[], None] | None, done: Done) -> Done:
    """``done``, preceded on success by ``post`` (an op's post-processing); an error
    ``post`` raises becomes the op's error."""
    if post is None:
        return done

    def post_then_done(error: BaseException | None) -> None:
        if error is None:
            try:
                post()
            except Exception as exc:
                error = exc
        done(error)

    return post_then_done


class IssuingGang(Gang):
    """A gang's numbering, scheduling, deadlines and lifecycle; collectives build on it."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        device: torch.device,
        backend: str,
        name: str,
        policy: GangPolicy,
    ) -> None:
        self._rank = rank
        self._size = size
        self._device = device
        self._backend = backend
        self._name = name
        self._policy = policy
        self._op_timeout = policy.op_timeout
        self._closed = False
        self._broken: BaseException | None = None
        self._lock = threading.RLock()
        self._next_seq = 0
        self._next_check = 0
        self._draining = False
        self._scheduler = Scheduler(policy.limits.max_ops, policy.limits.max_bytes)
        self._room = Room(
            self._lock, self._scheduler.is_full, self._check_usable, policy.limits, name
        )
        self._armed_at: float | None = None
        self._armed_driver: object = None
        self._armed_cancel: _deadline.Cancel | None = None
        self._counters = Counters()
        self._children: list[IssuingGang] = []
        self._ops_left_in_backend = False
        self._released = False

    # Properties.

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    @override
    def backend(self) -> str:
        return self._backend

    @property
    @override
    def name(self) -> str:
        return self._name

    @property
    @override
    def closed(self) -> bool:
        return self._closed

    @property
    def policy(self) -> GangPolicy:
        """The gang's timeout, in-flight and order-checking policy."""
        return self._policy

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} '{self._name}' rank {self._rank} of {self._size} "
            f"{self._backend} {self._device}>"
        )

    # Hooks the implementations may override.

    def _abort_backend(self) -> None:
        """Stops the communicator after a failure; must not block. Default: nothing."""

    def _release_backend(self, *, pending: bool) -> None:
        """Frees the backend on close; runs off the loop and may block briefly."""

    def _later(self, start: Callable[[], None]) -> Callable[[], None]:
        """Wraps a start that may run later, on another thread, as if run now.

        The default needs nothing; CUDA gangs restore the caller's current stream.
        """
        return start

    def _start_census(self, index: int, report: Callable[[list[int] | None], None]) -> None:
        """Reports which ranks had not reached this gang's ``index``-th order check, once
        its op's deadline passed there; None when that cannot be known (the default).
        May report later, from another thread."""
        report(None)

    def _start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        """Compares this rank's ``index``-th collective's fingerprint with every rank's.

        The default (one simulated rank) always agrees.
        """
        checked(None, None)

    # Numbering and admission (rules 1, 2 and 7).

    def _context(self, op: str, seq: int, timeout: float | None) -> OpContext:
        return OpContext(self._name, self._rank, self._size, op, seq, timeout)

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        seconds = check_timeout(timeout)
        if seconds is None:
            return self._op_timeout
        return None if math.isinf(seconds) else seconds

    def _check_usable(self) -> None:
        if self._closed:
            raise GangClosedError(f"Gang '{self._name}' is closed; make a new one.")
        if self._broken is not None:
            raise GangBrokenError(
                f"Gang '{self._name}' is broken by an earlier failure and refuses every op: "
                f"{self._broken}",
                self._broken,
            ) from self._broken

    def _new_handle(
        self,
        op: str,
        timeout: float | None,
        busy: Sequence[tuple[str, torch.Tensor]],
        num_bytes: int | None = None,
    ) -> tuple[Handle[Any], _busy.Claim]:
        """Numbers the op and marks its tensors busy, atomically (rule 2)."""
        seconds = self._op_timeout if timeout is None else self._resolve_timeout(timeout)
        if self._closed or self._broken is not None:
            self._check_usable()
        if num_bytes is None:
            num_bytes = sum(t.numel() * t.element_size() for _, t in busy)
        with self._lock:
            self._room.wait_or_refuse(op, num_bytes, seconds)
            seq = self._next_seq
            handle: Handle[Any] = Handle(op=op, seq=seq, num_bytes=num_bytes, timeout=seconds)
            claim = _busy.acquire(busy, handle)  # raises before anything is committed
            self._next_seq = seq + 1
            self._counters.num_issued += 1
            self._counters.bytes_issued += num_bytes
        handle._observer = self._observe_lag
        handle._before_wait = self._rearm_for_waiter
        return handle, claim

    @override
    async def wait_for_room(self, num_bytes: int = 0) -> None:
        await self._room.wait(check_non_negative_int(num_bytes, name="num_bytes"))

    def _admit(
        self,
        handle: Handle[Any],
        start: Callable[[], None],
        abandon: Done,
        *,
        fingerprint: str | None = None,
        holds_gate: bool = False,
    ) -> None:
        """Hands a numbered op to the core and starts what may start (rules 2 and 7)."""
        deadline = None if handle.timeout is None else handle.issued_at + handle.timeout
        checked = fingerprint is not None and self._policy.check_order
        entry = Entry(
            seq=handle.seq,
            op=handle.op,
            num_bytes=handle.num_bytes,
            issued_at=handle.issued_at,
            deadline=deadline,
            start=self._later(start),
            item=(handle, abandon),
            ready=not checked,
            holds_gate=holds_gate,
        )
        with self._lock:
            self._scheduler.admit(entry)
            if checked:
                assert fingerprint is not None
                index = entry.check_index = self._next_check
                self._next_check += 1
                self._check_order(entry, index, fingerprint)
            self._drain()
        if deadline is not None:
            self._arm(deadline)

    def _drain(self) -> None:
        """Starts every op the core lets start, in order; re-entrant calls return."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
            try:
                while (entry := self._scheduler.take_next()) is not None:
                    entry.start()
            finally:
                self._draining = False

    def _check_order(self, entry: Entry, index: int, fingerprint: str) -> None:
        handle, abandon = entry.item

        def checked(fingerprints: dict[int, str] | None, error: BaseException | None) -> None:
            if error is None and fingerprints is not None:
                error = self._mismatch(handle, index, fingerprints)
            if error is not None:
                abandon(error)  # never started: no c10d call will report it
                return
            with self._lock:
                self._scheduler.set_ready(handle.seq)
                self._drain()

        try:
            self._start_order_check(index, fingerprint, checked)
        except Exception as exc:
            checked(None, exc)

    def _mismatch(
        self, handle: Handle[Any], index: int, fingerprints: dict[int, str]
    ) -> CollectiveMismatchError:
        groups: dict[str, list[int]] = {}
        for rank, fingerprint in sorted(fingerprints.items()):
            groups.setdefault(fingerprint, []).append(rank)
        sides = "; ".join(f"ranks {ranks} issued {fp}" for fp, ranks in groups.items())
        context = self._context(handle.op, handle.seq, handle.timeout)
        return CollectiveMismatchError(
            f"{context.describe()}: the ranks issued different collectives at collective "
            f"#{index} of this gang: {sides}. Nothing was started; the gang is now broken.",
            context,
            fingerprints,
        )

    # Completion (rule 3).

    def _complete(self, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
        now = time.monotonic()
        # A handle that already failed (its deadline passed) records as timed out.
        earlier = handle._error
        timed_out = isinstance(earlier, GangTimeoutError)
        outcome = "timed out" if timed_out else ("ok" if error is None else "failed")
        with self._lock:
            self._scheduler.finish(handle.seq, seconds=now - handle.issued_at, outcome=outcome)
            room_waiters = self._room.wake()
        for waiter in room_waiters:
            waiter._finish(None, None)
        if error is None:

            def count_completed() -> None:
                with self._lock:
                    self._counters.completed(handle.op, time.monotonic() - handle.issued_at)

            handle._finish(value, None, then=count_completed)
        else:
            if isinstance(error, GangBrokenError | GangClosedError | CollectiveError):
                wrapped: BaseException = error
            else:
                context = self._context(handle.op, handle.seq, handle.timeout)
                wrapped = CollectiveError(f"{context.describe()} failed: {error}", context)
                wrapped.__cause__ = error

            def count_failed_and_break() -> None:
                with self._lock:
                    self._counters.num_failed += 1
                self._break(wrapped)

            # Broken before the waiters wake: their next call must be refused (rule 5).
            finished = handle._finish(None, wrapped, then=count_failed_and_break)
            if not finished and not isinstance(error, GangBrokenError | GangClosedError):
                # The handle had timed out (on_timeout="raise"); c10d then failed the op
                # itself, so the communicator is unusable all the same.
                self._break(wrapped)
        self._drain()

    def _observe_lag(self, seconds: float) -> None:
        with self._lock:
            self._counters.lags.append(seconds)

    # Deadlines (rule 4).

    def _arm(self, deadline: float) -> None:
        driver = _deadline.current_driver()
        with self._lock:
            if (
                self._armed_at is not None
                and self._armed_at <= deadline
                and self._armed_driver is driver
                and _deadline.alive(driver)
            ):
                return
            replaced, self._armed_cancel = self._armed_cancel, None
            self._armed_at = deadline
            self._armed_driver = driver
        if replaced is not None:
            replaced()
        cancel = _deadline.call_at(
            driver, deadline, lambda: self._check_deadlines(deadline, driver)
        )
        with self._lock:
            if self._armed_at == deadline and self._armed_driver is driver:
                self._armed_cancel = cancel

    def _rearm_for_waiter(self) -> None:
        """A waiter starts on a pending op: if the deadline check was armed on a driver
        that is gone (an asyncio loop that closed), re-arm it where the waiter runs."""
        armed_at, driver = self._armed_at, self._armed_driver
        if armed_at is None or _deadline.alive(driver):  # the common case, without the lock
            return
        with self._lock:
            if self._armed_at is None or _deadline.alive(self._armed_driver):
                return
            self._armed_at = None
            self._armed_cancel = None
            following = self._scheduler.next_deadline()
        if following is not None:
            self._arm(following)

    def _check_deadlines(self, armed_for: float, driver: object) -> None:
        now = time.monotonic()
        with self._lock:
            if driver is not None and self._armed_at == armed_for:
                # The loop ran this timer late by however long it was busy or blocked.
                self._counters.lags.append(max(0.0, now - armed_for))
            if self._armed_at == armed_for:
                self._armed_at = None
                self._armed_cancel = None
            due = self._scheduler.due(now)
            following = self._scheduler.next_deadline()
        if following is not None:
            self._arm(following)
        for entry in due:
            handle, _ = entry.item
            index = entry.check_index
            if index is not None and not entry.ready:
                # Still in its order check: ask who never reached it (rule 4), then fail.
                self._start_census(index, functools.partial(self._expire, handle, index))
            else:
                self._expire(handle)

    def _expire(
        self, handle: Handle[Any], index: int | None = None, absent: list[int] | None = None
    ) -> None:
        now = time.monotonic()
        with self._lock:
            in_flight = self._scheduler.describe_in_flight(now, skip=handle.seq)
            recent = [record.describe() for record in self._scheduler.recent()]
        context = self._context(handle.op, handle.seq, handle.timeout)
        elapsed = now - handle.issued_at
        abort = self._policy.on_timeout == "abort"
        consequence = (
            "The gang is now broken."
            if abort
            else "Its tensors stay busy until the op really ends; the gang stays usable."
        )
        if absent:
            why = (
                f"ranks {absent} had not issued collective #{index} of this gang (order "
                f"checking got no fingerprint of theirs): they skipped it, or are stalled "
                f"or late before it."
            )
        else:
            why = "a peer may be late, stopped, or issuing its ops in another order."
        error = GangTimeoutError(
            f"{context.describe()} timed out after {elapsed:.3f} s; {why} {consequence}",
            context,
            elapsed=elapsed,
            in_flight=in_flight,
            recent=recent,
            absent_ranks=absent or (),
        )

        def count_timed_out() -> None:
            with self._lock:
                self._counters.num_timed_out += 1
            if abort:
                self._break(error)

        # Broken before the waiters wake: their next call must be refused (rule 5).
        handle._finish(None, error, then=count_timed_out)

    # Failure and lifecycle (rules 5 and 6).

    def _take_pending(self) -> tuple[list[Handle[Any]], list[tuple[Handle[Any], Done]]]:
        """The pending handles, and the never-started ops, now dropped from the queue.

        The caller holds the lock and has just marked the gang broken or closed; it
        fails them outside the lock.
        """
        items = [entry.item for entry in self._scheduler.entries.values()]
        dropped = [entry.item for entry in self._scheduler.drop_queued()]
        pending = [handle for handle, _ in items if not handle._settled()]
        self._counters.num_failed += len(pending)
        self._ops_left_in_backend = any(e.started for e in self._scheduler.entries.values())
        pending.extend(self._room.wake())  # they fail with the others, and re-check
        return pending, dropped

    def _break(self, cause: BaseException) -> None:
        def abandoned(handle: Handle[Any]) -> BaseException:
            error = GangBrokenError(
                f"`{handle.op}` (seq {handle.seq}) on gang '{self._name}' was abandoned: "
                f"the gang broke on an earlier failure: {cause}",
                cause,
            )
            error.__cause__ = cause
            return error

        with self._lock:
            if self._broken is not None or self._closed:
                return
            self._broken = cause
            pending, dropped = self._take_pending()
        log.error("Gang '%s' (rank %d) is broken: %s", self._name, self._rank, cause)
        for handle in pending:
            handle._finish(None, abandoned(handle))
        for handle, abandon in dropped:
            abandon(abandoned(handle))  # releases their tensors; nothing was started
        try:
            # A woken waiter may have closed the gang meanwhile; the implementations
            # cope with a backend that is already released.
            self._abort_backend()
        except Exception:
            log.exception("Aborting the communicator of gang '%s' failed.", self._name)

    def _mark_closed(self) -> None:
        """Closes this gang and its sub-gangs at once: pending waiters fail right away."""

        def closed(handle: Handle[Any]) -> BaseException:
            return GangClosedError(
                f"`{handle.op}` (seq {handle.seq}) was pending when gang '{self._name}' was closed."
            )

        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, dropped = self._take_pending()
            children = list(self._children)
        for handle in pending:
            handle._finish(None, closed(handle))
        for handle, abandon in dropped:
            abandon(closed(handle))
        for child in children:
            child._mark_closed()

    def _release_all(self) -> None:
        """Frees the backends of this gang's sub-gangs, then its own; may block briefly."""
        with self._lock:
            if self._released:
                return
            self._released = True
            children = list(self._children)
        for child in children:
            child._release_all()
        self._release_backend(pending=self._ops_left_in_backend)

    @override
    async def close(self) -> None:
        if self._closed:
            return
        from agang._offload import run_blocking

        self._mark_closed()
        await run_blocking(
            self._release_all, name=f"close gang '{self._name}'", seconds=self._close_timeout()
        )

    @override
    def close_sync(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._release_all()

    def _close_timeout(self) -> float:
        return 5.0

    @override
    def statistics(self) -> GangStatistics:
        with self._lock:
            return self._counters.snapshot(
                num_in_flight=self._scheduler.num_in_flight,
                num_queued=self._scheduler.num_queued,
                bytes_in_flight=self._scheduler.bytes_in_flight,
            )
