"""The engine of one gang: numbering, admission, completion, deadlines, failure, closing.

A gang holds one engine and one backend. The engine feeds the scheduler's pure core
(``scheduler``) under the gang's one lock, starts what the core hands back through the
backend, and owns everything that happens to an op between the user's call and its
handle finishing. It is not a ``Gang``: the gang validates the call and asks the engine
to issue it; the engine only calls the backend (``agang._backends.contract``).

Rules:
1. *A bad call changes nothing.* The gang checks its input first; only then does the
   engine number the op, so ranks stay in step after a caught ``ValueError``.
2. *Numbered and claimed at once.* Taking a sequence number and marking the op's
   tensors busy is one step under the lock; the op is then admitted to the core, which
   starts ops in sequence order. An op that cannot start at once is started later by
   whichever thread frees room for it (a completion, an order check, the gate opening),
   through the backend's ``defer``, as if from the caller. A bounded gang whose policy
   is ``"raise"`` or ``"block"`` refuses, or waits, before numbering (``room``).
3. *A timeout is resolved once.* At the call, into seconds or None (no deadline);
   nothing below re-reads the user's value. The backend hears of every explicit
   timeout (``allow_timeout``) so that its own stays behind it.
4. *The end is reported once.* A started op reports through ``done(error)``, once, from
   any thread. Its tensors are released then, and only then (the backend may write into
   them until then).
5. *One deadline timer per gang.* Deadlines are checked by one timer on the issuer's
   loop (or the timer thread; ``deadline``), armed for the core's next deadline. When
   one passes, the handle fails with ``GangTimeoutError`` carrying the flight recorder;
   with ``on_timeout="abort"`` the gang then breaks, with ``"raise"`` only that handle
   fails and its op stays in flight (tensors busy) until the backend ends it. The error
   says where each peer stood, asked through the backend's blame within its bound
   (``expiry``): issued the op and waiting, not issued it yet, or no answer.
6. *A failure breaks the gang.* Any failure of a started op breaks the gang: every
   pending handle fails with ``GangBrokenError`` (the first cause attached), queued ops
   are dropped unstarted, the backend is aborted, and every later call (a woken
   waiter's too) raises at once without touching the backend.
7. *Closing.* Closing fails pending handles with ``GangClosedError`` at once; the
   backend is released afterwards, off the loop.
8. *Order checks.* With order checking on, each collective's fingerprint goes to the
   backend's check when it is admitted (checks run in admission order, pipelined); the
   op becomes ready only once every rank's fingerprint agreed. A mismatch fails the op
   with ``CollectiveMismatchError`` on every rank and breaks the gang before it starts.
9. *Two phases.* An op whose second step depends on the first one's result (the object
   collectives: sizes, then bytes) holds the core's gate between its phases, so later
   ops start after its second phase on every rank.
10. *Ordered, then done.* An op the backend reports ordered before it ran (NCCL's
   stream-ordered mode) finishes its handle then, successfully, but stays in flight
   until its end is reported: a deadline or a failure meanwhile breaks the gang.
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

from agang import _fork
from agang._backends.contract import Backend, Done
from agang._blame import Progress, State
from agang._engine import busy, deadline, reports
from agang._engine.call_site import call_site
from agang._engine.expiry import Expiry
from agang._engine.ops import OpEnd, SecondPhase, Start, start_guarded
from agang._engine.room import Room
from agang._engine.scheduler import Entry, Scheduler
from agang._errors import (
    CollectiveError,
    GangBrokenError,
    GangClosedError,
    GangInheritedError,
    GangTimeoutError,
    OpContext,
)
from agang._handle import Handle
from agang._policy import GangPolicy
from agang._statistics import Counters, GangStatistics
from agang._validate import check_timeout

log = logging.getLogger("agang")


class Engine:
    """The op machinery of one gang over one backend (see the module's rules)."""

    def __init__(self, backend: Backend, policy: GangPolicy) -> None:
        self.backend = backend
        self.policy = policy
        self.name = backend.name
        self.rank = backend.rank
        self.size = backend.size
        #: The timeout of an op called without one (seconds, or None for no deadline).
        self.default_seconds = policy.op_timeout
        #: Closed (``close`` was called); read without the lock on the fast path.
        self.closed = False
        #: What broke the gang, or None while it is not broken.
        self.broken: BaseException | None = None
        self.lock = threading.RLock()
        self._next_seq = 0
        self._next_check = 0
        self._draining = False
        self._scheduler = Scheduler(policy.limits.max_ops, policy.limits.max_bytes)
        self._room = Room(
            self.lock, self._scheduler.is_full, self.check_usable, policy.limits, self.name
        )
        self._expiry = Expiry(self)
        self._alarm = deadline.Alarm(self.lock, self._expiry.check)
        self._last_op: str | None = None
        self._counters = Counters()
        self._ops_left_in_backend = False
        self._released = False
        self._ordered_early: set[int] = set()  # seqs reported ordered, not ended (rule 10)
        backend.allow_timeout(policy.op_timeout)
        backend.serve_progress(self.progress)
        _fork.track(self)

    # Numbering and admission (rules 1, 2, 3 and 8).

    def resolve_timeout(self, timeout: float | None) -> float | None:
        """The user's ``timeout`` as seconds, or None for no deadline (rule 3)."""
        if timeout is None:
            return self.default_seconds
        seconds = check_timeout(timeout)
        resolved = None if seconds is None or math.isinf(seconds) else seconds
        self.backend.allow_timeout(resolved)
        return resolved

    def context(self, op: str, seq: int, timeout: float | None) -> OpContext:
        return OpContext(self.name, self.rank, self.size, op, seq, timeout)

    def check_usable(self) -> None:
        if isinstance(self.broken, GangInheritedError):  # checked first: the clearest
            raise GangInheritedError(str(self.broken))
        if self.closed:
            raise GangClosedError(f"Gang '{self.name}' is closed; make a new one.")
        if self.broken is not None:
            raise GangBrokenError(
                f"Gang '{self.name}' is broken by an earlier failure and refuses every op: "
                f"{self.broken}",
                self.broken,
            ) from self.broken

    def new_handle(
        self,
        op: str,
        seconds: float | None,
        tensors: Sequence[tuple[str, torch.Tensor]],
        num_bytes: int | None = None,
    ) -> tuple[Handle[Any], busy.Claim]:
        """Numbers the op and marks its tensors busy, atomically (rule 2)."""
        if self.closed or self.broken is not None:
            self.check_usable()
        if num_bytes is None:
            num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        with self.lock:
            self._room.wait_or_refuse(op, num_bytes, seconds)
            seq = self._next_seq
            handle: Handle[Any] = Handle(
                op=op, seq=seq, num_bytes=num_bytes, timeout=seconds, owner=self
            )
            claim = busy.acquire(tensors, handle)  # raises before anything is committed
            self._next_seq = seq + 1
            self._last_op = op
            self._counters.num_issued += 1
            self._counters.bytes_issued += num_bytes
        return handle, claim

    def issue(
        self,
        op: str,
        tensors: Sequence[tuple[str, torch.Tensor]],
        output: Any,
        seconds: float | None,
        start: Start,
        *,
        fingerprint: str | None = None,
    ) -> Handle[Any]:
        """Numbers, admits and (room permitting) starts one backend op; its handle
        finishes with ``output``."""
        handle, claim = self.new_handle(op, seconds, tensors)
        done = OpEnd(self, handle, output, functools.partial(busy.release, claim))
        self.admit(handle, start, done, fingerprint=fingerprint)
        return handle

    async def wait_for_room(self, num_bytes: int) -> None:
        await self._room.wait(num_bytes)

    def admit(
        self,
        handle: Handle[Any],
        start: Start,
        done: Done,
        *,
        fingerprint: str | None = None,
        holds_gate: bool = False,
    ) -> None:
        """Hands a numbered op to the core and starts what may start (rules 2 and 8).

        ``done`` ends the op; it is also how a never-started op is abandoned.
        """
        due = None if handle.timeout is None else handle.issued_at + handle.timeout
        checked = fingerprint is not None and self.policy.check_order is not False
        entry = Entry(
            seq=handle.seq,
            op=handle.op,
            num_bytes=handle.num_bytes,
            issued_at=handle.issued_at,
            deadline=due,
            start=self.backend.defer(functools.partial(start_guarded, start, done)),
            item=(handle, done),
            ready=not checked,
            holds_gate=holds_gate,
        )
        with self.lock:
            self._scheduler.admit(entry)
            if checked:
                assert fingerprint is not None
                if self.policy.check_order == "call_site":
                    fingerprint = f"{fingerprint} at {call_site()}"
                index = entry.check_index = self._next_check
                self._next_check += 1
                self._check_order(entry, index, fingerprint)
            self._drain()
        if due is not None:
            self._alarm.arm(due)

    def _drain(self) -> None:
        """Starts every op the core lets start, in order; re-entrant calls return."""
        with self.lock:
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
                context = self.context(handle.op, handle.seq, handle.timeout)
                error = reports.mismatch(context, index, fingerprints)
            if error is not None:
                abandon(error)  # never started: no backend call will report it
                return
            with self.lock:
                self._scheduler.set_ready(handle.seq)
                self._drain()

        try:
            self.backend.start_order_check(index, fingerprint, checked)
        except Exception as exc:
            checked(None, exc)

    def issue_two_phase(
        self,
        op: str,
        seconds: float | None,
        num_bytes: int,
        first: Start,
        second: SecondPhase,
        *,
        fingerprint: str,
    ) -> Handle[Any]:
        """Issues an op whose second step depends on the first one's result (rule 9)."""
        handle, _ = self.new_handle(op, seconds, [], num_bytes)

        def fail(error: BaseException | None) -> None:
            self.complete(handle, None, error)

        def start_second(start: Start, result: Callable[[], Any]) -> None:
            def done(error: BaseException | None) -> None:
                if error is not None:
                    self.complete(handle, None, error)
                    return
                try:
                    value = result()
                except Exception as exc:  # a value that cannot be made (objects decode later)
                    self.complete(handle, None, exc)
                    return
                self.complete(handle, value, None)

            start_guarded(start, done)

        def after_first(error: BaseException | None) -> None:
            if error is not None:
                self.complete(handle, None, error)
                return
            with self.lock:
                if self.broken is None and not self.closed:
                    second(start_second)
                self._scheduler.release_gate(handle.seq)
                self._drain()

        self.admit(
            handle,
            lambda done: first(after_first),
            fail,
            fingerprint=fingerprint,
            holds_gate=True,
        )
        return handle

    # Completion (rule 4).

    def complete(self, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
        """The backend op behind ``handle`` has ended (its tensors are free)."""
        now = time.monotonic()
        # A handle that already failed (its deadline passed) records as timed out.
        timed_out = isinstance(handle._error, GangTimeoutError)
        outcome = "timed out" if timed_out else ("ok" if error is None else "failed")
        with self.lock:
            self._scheduler.finish(handle.seq, seconds=now - handle.issued_at, outcome=outcome)
            room_waiters = self._room.wake()
            if self._ordered_early and handle.seq in self._ordered_early:
                self._ordered_early.discard(handle.seq)
                if error is None:
                    self._counters.completed(handle.op, now - handle.issued_at)
        for waiter in room_waiters:
            waiter._finish(None, None)
        if error is None:

            def count_completed() -> None:
                with self.lock:
                    self._counters.completed(handle.op, time.monotonic() - handle.issued_at)

            handle._finish(value, None, then=count_completed)
        else:
            if isinstance(error, GangBrokenError | GangClosedError | CollectiveError):
                wrapped: BaseException = error
            else:
                context = self.context(handle.op, handle.seq, handle.timeout)
                explained = f"{context.describe()} failed: {error}{self.backend.explain(error)}"
                wrapped = CollectiveError(explained, context)
                wrapped.__cause__ = error

            def count_failed_and_break() -> None:
                with self.lock:
                    self._counters.num_failed += 1
                self.break_gang(wrapped)

            # Broken before the waiters wake: their next call must be refused (rule 6).
            finished = handle._finish(None, wrapped, then=count_failed_and_break)
            if not finished and not isinstance(error, GangBrokenError | GangClosedError):
                # Timed out (on_timeout="raise"), then failed in c10d: unusable all the same.
                self.break_gang(wrapped)
        self._drain()

    def ordered(self, handle: Handle[Any], value: Any) -> None:
        """The op behind ``handle`` is ordered on the caller's stream (rule 10)."""
        with self.lock:
            self._ordered_early.add(handle.seq)
        handle._finish(value, None)

    def count_coalesced(self, num_members: int) -> None:
        with self.lock:
            self._counters.num_coalesced += num_members

    # What a handle tells its owner (``agang._handle.HandleOwner``).

    def resumed(self, lag: float) -> None:
        with self.lock:
            self._counters.lags.append(lag)

    def waiting(self) -> None:
        """A waiter starts on a pending op: if the deadline check was armed on a driver
        that is gone (an asyncio loop that closed), re-arm it where the waiter runs."""
        if not self._alarm.disarm_if_lost():
            return
        with self.lock:
            following = self._scheduler.next_deadline()
        if following is not None:
            self._alarm.arm(following)

    # Blame (rule 5): where this rank stands, when a peer's deadline asks.

    def progress(self, seq: int) -> Progress:
        with self.lock:
            state: State = "closed" if self.closed else "open" if self.broken is None else "broken"
            return Progress(
                asked=seq,
                issued=self._next_seq - 1,
                op=self._last_op,
                waiting=seq in self._scheduler.entries,
                num_in_flight=len(self._scheduler.entries),
                state=state,
            )

    # Failure and lifecycle (rules 6 and 7).

    def _take_pending(self) -> tuple[list[Any], list[tuple[Handle[Any], Done]]]:
        """The pending handles, room waiters and never-started ops (now dropped); the caller
        holds the lock, has marked the gang broken or closed, and fails them unlocked."""
        items = [entry.item for entry in self._scheduler.entries.values()]
        dropped = [entry.item for entry in self._scheduler.drop_queued()]
        pending: list[Any] = [handle for handle, _ in items if not handle._settled()]
        self._counters.num_failed += len(pending)
        self._ops_left_in_backend = any(e.started for e in self._scheduler.entries.values())
        pending.extend(self._room.wake())  # they fail with the others, and re-check
        return pending, dropped

    def break_gang(self, cause: BaseException) -> None:
        """Marks the gang broken by ``cause``, fails what is pending, aborts the backend."""

        def abandoned(what: object) -> BaseException:
            error = GangBrokenError(
                f"{what} on gang '{self.name}' was abandoned: the gang broke on an earlier "
                f"failure: {cause}",
                cause,
            )
            error.__cause__ = cause
            return error

        with self.lock:
            if self.broken is not None or self.closed:
                return
            self.broken = cause
            pending, dropped = self._take_pending()
        log.error("Gang '%s' (rank %d) is broken: %s", self.name, self.rank, cause)
        for future in pending:
            future._finish(None, abandoned(future))
        for handle, abandon in dropped:
            abandon(abandoned(handle))  # releases their tensors; nothing was started
        try:
            # A woken waiter may have closed it meanwhile: backends cope with abort after release.
            self.backend.abort()
        except Exception:
            log.exception("Aborting the communicator of gang '%s' failed.", self.name)

    def mark_closed(self) -> bool:
        """Closes the gang at once, failing pending waiters (rule 7); False if closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            pending, dropped = self._take_pending()
        for future in pending:
            future._finish(
                None, GangClosedError(f"{future} was pending when gang '{self.name}' was closed.")
            )
        for handle, abandon in dropped:
            abandon(GangClosedError(f"{handle} was pending when gang '{self.name}' was closed."))
        return True

    def release(self) -> None:
        """Frees the backend once the gang is closed; off the loop, may block briefly."""
        with self.lock:
            if self._released:
                return
            self._released = True
            unfinished = self._ops_left_in_backend or self.broken is not None
        self.backend.release(unfinished=unfinished)

    def statistics(self) -> GangStatistics:
        with self.lock:
            return self._counters.snapshot(
                num_in_flight=self._scheduler.num_in_flight,
                num_queued=self._scheduler.num_queued,
                bytes_in_flight=self._scheduler.bytes_in_flight,
            )
