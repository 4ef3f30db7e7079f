"""The engine of one gang: numbering, admission, completion, deadlines, failure, closing.
It is one piece, a kernel in sections (as trio's run loop is): every rule below reads
and writes the same state under the gang's one lock (the numbers, the scheduler's core,
the op being started inline, the ops ordered early, the counters), and the common op is
numbered, started and ended in one pass through it, where a split would have each half
read the other's fields. What needs none of that state lives beside it, reached through
narrow calls: ``scheduler``, ``room``, ``busy``, ``deadlines``, ``polling``,
``order_checks``, ``reports``, ``ops``. Its sections, in order: state, admission, the
fast path, queued ops and order checks, two phases, completion, failure and closing, what
a handle tells its owner, what the deadline check asks, blame, lifecycle.

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
   The common op (it may start at once, no order check) is numbered, claimed and
   started on the caller's thread under that same taking of the lock, and enters the
   core as started only if it did not end inside its start: one that did (the fake
   backend's all do) is recorded and counted, nothing more, since no other thread can
   see the core meanwhile (``Engine._start_now``).
3. *A timeout is resolved once.* At the call, into seconds or None (no deadline);
   nothing below re-reads the user's value. The backend hears of every explicit
   timeout (``allow_timeout``) so that its own stays behind it.
4. *The end is reported once.* A started op reports through ``done(error)``, once, from
   any thread. Its tensors are released then, and only then (the backend may write into
   them until then).
5. *One deadline timer per gang.* Deadlines are checked by one timer on the issuer's
   loop (or the timer thread; ``deadlines``), armed for the core's next deadline. When
   one passes, the handle fails with ``GangTimeoutError`` carrying the flight recorder;
   with ``on_timeout="abort"`` the gang then breaks, with ``"raise"`` only that handle
   fails and its op stays in flight (tensors busy) until the backend ends it. The error
   says where each peer stood, asked through the backend's blame within its bound
   (``deadlines.Expiry``): issued the op and waiting, not issued it yet, or no answer.
   A collective is asked about by its number among the gang's collectives, not its
   sequence number: point-to-point ops among some ranks advance only theirs, so a
   sequence number is not the same op on every rank (``Engine.progress``).
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
   A check that fails (an error, not a mismatch) is applied behind the checks issued
   before it, and a started op's failure behind the checks open then, so a peer's
   mismatch, whose abort fails what is in flight on the other ranks, is every rank's
   first cause (``order_checks``).
9. *Two phases.* An op whose second step depends on the first one's result (the object
   collectives: sizes, then bytes) holds the core's gate between its phases, so later
   ops start after its second phase on every rank.
10. *Ordered, then done.* An op the backend reports ordered before it ran (NCCL's
   stream-ordered mode) finishes its handle then, successfully, but stays in flight
   until its end is reported: a deadline or a failure meanwhile breaks the gang.
11. *Learned on the loop.* Where the backend learns of an end only when asked (NCCL; the
   contract's "Learning of an end"), the engine asks at each issue, and a task that
   awaits an op polls on its own loop, one loop pass between polls (it never blocks the
   loop), until the op ends or its budget passes: three times the median of the gang's
   recent ops, from 200 to 500 µs after the op's issue (none when the gang's ops take
   longer). Past it, and for a plain thread's ``wait``, the backend parks the op on a
   thread of its own. The deadline timer also fires 2 ms after an issue, and parks what
   nobody awaited and is still running, so every op's end is learned. An op awaited
   soon after a quick end thus needs no thread hand-off at all (``polling``).
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

from agang._backends.contract import Backend, Done, Progress, State
from agang._backends.fingerprint import at_call_site, call_site
from agang._engine import busy, reports
from agang._engine.deadlines import Expiry
from agang._engine.ops import POINT_TO_POINT, Fingerprint, OpEnd, SecondPhase, Start, start_guarded
from agang._engine.order_checks import OrderChecks
from agang._engine.polling import Polling
from agang._engine.room import Room
from agang._engine.scheduler import Entry, Scheduler
from agang._errors import (
    CollectiveError,
    GangBrokenError,
    GangClosedError,
    GangError,
    GangInheritedError,
    GangTimeoutError,
    OpContext,
)
from agang._handle import Handle, collective_of, issued
from agang._policy import GangPolicy
from agang._runtime import fork
from agang._runtime.future import error_of, finish, finish_unseen, settled
from agang._statistics import Counters, GangStatistics
from agang._validate import check_timeout

log = logging.getLogger("agang.engine")


def _started() -> None:
    """The ``start`` of an entry the engine started at once, never called."""


class Engine:
    """The op machinery of one gang over one backend (see the module's rules)."""

    # ---- State ----

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
        # Read per op, so kept as plain attributes: whether fingerprints are compared
        # (callers build one only then; rule 8), and whether the in-flight bounds must be
        # judged before an op is numbered (rule 2).
        self.checks_order = policy.check_order is not False
        self._judges_room = policy.limits.when_full != "queue"
        self._next_seq = 0
        self._next_collective = 0  # rule 5: what blame asks a collective about
        self._next_check = 0
        self._checks = OrderChecks(self.name)  # rule 8: failures behind earlier checks
        self._draining = False
        self._inline: OpEnd | None = None  # the op ``_start_now`` is starting, on
        self._inline_thread = 0  # this thread
        self._scheduler = Scheduler(policy.limits.max_ops, policy.limits.max_bytes)
        self._room = Room(
            self.lock, self._scheduler.is_full, self.check_usable, policy.limits, self.name
        )
        self._expiry = Expiry(self, self.lock)
        self._alarm = self._expiry.alarm
        self._last_op: str | None = None
        self._counters = Counters()
        self._ops_left_in_backend = False
        self._released = False
        self._ordered_early: set[int] = set()  # seqs reported ordered, not ended (rule 10)
        #: Whether the backend learns of ends only when asked (rule 11).
        self.polls = backend.polls
        self._polling = Polling(backend)
        #: One poll for a task about to await an op (``agang._handle.HandleOwner``).
        self.learn = self._polling.learn
        backend.allow_timeout(policy.op_timeout)
        backend.serve_progress(self.progress)
        fork.track(self)

    # ---- Admission: numbering, claiming, issuing (rules 1, 2 and 3) ----

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

    def new_handle(self, op: str, seconds: float | None, num_bytes: int) -> Handle[Any]:
        """Numbers an op whose memory its caller claims (flat ops: their members';
        two-phase ops: none of the user's), for ``admit`` (rule 2)."""
        if self.closed or self.broken is not None:
            self.check_usable()
        with self.lock:
            handle, _ = self._number_and_claim(op, (), num_bytes, seconds)
        return handle

    def _number_and_claim(
        self,
        op: str,
        tensors: Sequence[tuple[str, torch.Tensor]],
        num_bytes: int,
        seconds: float | None,
    ) -> tuple[Handle[Any], busy.Claim]:
        """Numbers the op and marks its tensors busy, as one step (rule 2); the caller
        holds the lock. Raises before anything is committed (rule 1)."""
        if self._judges_room:
            self._room.wait_or_refuse(op, num_bytes, seconds)
        seq = self._next_seq
        collective = -1 if op in POINT_TO_POINT else self._next_collective
        handle = issued(op, seq, num_bytes, seconds, self, collective)
        if len(tensors) == 1:  # most ops: the one-range claim, without building a list
            name, tensor = tensors[0]
            claim = busy.acquire_one(name, tensor, handle)
        else:
            claim = busy.acquire(tensors, handle)
        self._next_seq = seq + 1
        if collective >= 0:  # committed with the seq, once nothing can raise (rule 1)
            self._next_collective = collective + 1
        self._last_op = op
        counters = self._counters
        counters.num_issued += 1
        counters.bytes_issued += num_bytes
        return handle, claim

    def issue(
        self,
        op: str,
        tensors: Sequence[tuple[str, torch.Tensor]],
        output: Any,
        seconds: float | None,
        start: Start,
        *,
        fingerprint: Fingerprint | None = None,
    ) -> Handle[Any]:
        """Numbers, admits and (room permitting) starts one backend op; its handle
        finishes with ``output``.

        The common op (nothing queued ahead of it, no order check) is numbered, claimed,
        admitted and started under one taking of the lock, on the caller's thread, with
        no deferred start made for it; any other goes through ``admit``.
        """
        if self.closed or self.broken is not None:
            self.check_usable()
        if self.polls:  # rule 11: what ended frees its room and memory first
            self.backend.poll()
        if len(tensors) == 1:
            num_bytes = tensors[0][1].nbytes  # contiguous (checked): numel * element_size
        else:
            num_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
        checked = fingerprint is not None and self.checks_order
        with self.lock:
            handle, claim = self._number_and_claim(op, tensors, num_bytes, seconds)
            done = OpEnd(self, handle, output, busy.release, claim, tensors)
            if checked or self._draining or not self._scheduler.may_start(num_bytes):
                due = None if seconds is None else handle.issued_at + seconds
                self._admit_locked(handle, start, done, due, fingerprint, False)
            else:
                due = self._start_now(handle, start, done, fingerprint)
        if self.polls:
            due = self._polling.next_check(due, handle.issued_at)
        if due is not None:
            self._alarm.arm(due)
        return handle

    # ---- The fast path: an op started on the caller's thread (rule 2) ----

    def _start_now(
        self, handle: Handle[Any], start: Start, done: OpEnd, fingerprint: Fingerprint | None
    ) -> float | None:
        """Starts an op that may start (nothing ahead of it) on the caller's thread, with
        the lock held; returns its deadline to arm, or None.

        The op enters the core only if it did not end inside its start. One that did
        (the fake backend's all do) never waited on anything, and other threads wait
        for the lock meanwhile, so nobody can tell: it is only recorded and counted,
        and its handle, not returned yet, finished without waking anyone. A polling
        backend's op enters first, since its end is only ever learned later (rule 11).
        """
        if self.polls:
            # A polling backend's op never ends inside its start (its end is learned by
            # asking, later): into the core first, then started, with no inline watch.
            due = self._enter_started(handle, done, fingerprint)
            try:
                start(done)
            except Exception as exc:  # as ``start_guarded``: the op's error
                done(exc)
            if self._scheduler.num_queued:
                self._drain()
            return due
        self._inline = done
        self._inline_thread = threading.get_ident()
        self._draining = True  # ops admitted meanwhile (re-entrant calls) wait for it
        try:
            start(done)
        except Exception as exc:  # as ``start_guarded``: the op's error
            done(exc)
        finally:
            self._draining = False
            self._inline = None
        due = None
        if not done.ended_inline:  # still running: into the core, as started
            due = self._enter_started(handle, done, fingerprint)
        elif done.inline_error is None and not self._ordered_early:
            now = time.monotonic()
            seconds = now - handle.issued_at
            record = self._scheduler.record
            record(handle.seq, handle.op, handle.num_bytes, seconds, "ok", collective_of(handle))
            self._counters.completed(handle.op, seconds)
            finish_unseen(handle, done.output, now)
        else:  # a failure, or ordered first: the general end, as if reported later
            self._enter_started(handle, done, fingerprint)
            self.complete(handle, done.output, done.inline_error)
        if self._scheduler.num_queued:
            self._drain()
        return due

    def _enter_started(
        self, handle: Handle[Any], done: OpEnd, fingerprint: Fingerprint | None
    ) -> float | None:
        """Enters into the core an op started by ``_start_now``; its deadline."""
        seconds = handle.timeout
        issued_at = handle.issued_at
        due = None if seconds is None else issued_at + seconds
        entry = Entry(handle.seq, handle.op, handle.num_bytes, issued_at, due, _started)
        entry.item = (handle, done)
        entry.collective, entry.fingerprint = collective_of(handle), fingerprint
        self._scheduler.admit_started(entry)
        return due

    def ends_inline(self, done: OpEnd) -> bool:
        """Whether ``done`` is called inside its op's start on the thread that started it
        (``_start_now``), which then takes the end once the start returns."""
        return self._inline is done and threading.get_ident() == self._inline_thread

    # ---- Queued ops and order checks (rules 2 and 8) ----

    async def wait_for_room(self, num_bytes: int) -> None:
        if self.polls:  # rule 11: ops that ended leave room
            self.backend.poll()
        await self._room.wait(num_bytes)

    def admit(
        self,
        handle: Handle[Any],
        start: Start,
        done: Done,
        *,
        fingerprint: Fingerprint | None = None,
        holds_gate: bool = False,
    ) -> None:
        """Hands a numbered op to the core and starts what may start (rules 2 and 8).

        ``done`` ends the op; it is also how a never-started op is abandoned.
        """
        due = None if handle.timeout is None else handle.issued_at + handle.timeout
        with self.lock:
            self._admit_locked(handle, start, done, due, fingerprint, holds_gate)
        if self.polls:
            due = self._polling.next_check(due, handle.issued_at)
        if due is not None:
            self._alarm.arm(due)

    def _admit_locked(
        self,
        handle: Handle[Any],
        start: Start,
        done: Done,
        due: float | None,
        fingerprint: Fingerprint | None,
        holds_gate: bool,
    ) -> None:
        """``admit`` once the lock is taken, but for the deadline's arming."""
        checked = fingerprint is not None and self.checks_order
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
            collective=collective_of(handle),
            fingerprint=fingerprint,
        )
        self._scheduler.admit(entry)
        if checked:
            assert fingerprint is not None
            text = fingerprint if isinstance(fingerprint, str) else fingerprint()
            if self.policy.check_order == "call_site":
                text = at_call_site(text, call_site())
            index = entry.check_index = self._next_check
            self._next_check += 1
            self._check_order(entry, index, text)
        self._drain()

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
            if error is not None:  # never started; as an agang error, not held again
                wrapped = error if isinstance(error, GangError) else self._wrap(handle, error)
                self._checks.failed(index, functools.partial(abandon, wrapped))
                return
            if fingerprints is not None:
                context = self.context(handle.op, handle.seq, handle.timeout)
                abandon(reports.mismatch(context, index, fingerprints))
            else:
                with self.lock:
                    self._scheduler.set_ready(handle.seq)
                    self._drain()
            self._checks.resolved(index)

        self._checks.opened(index)
        try:
            self.backend.start_order_check(index, fingerprint, checked)
        except Exception as exc:
            checked(None, exc)

    # ---- Two phases (rule 9) ----

    def issue_two_phase(
        self,
        op: str,
        seconds: float | None,
        num_bytes: int,
        first: Start,
        second: SecondPhase,
        *,
        fingerprint: Fingerprint,
    ) -> Handle[Any]:
        """Issues an op whose second step depends on the first one's result (rule 9)."""
        handle = self.new_handle(op, seconds, num_bytes)

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

    # ---- Completion (rules 4 and 10) ----
    # An op's end comes back through its ``OpEnd`` (``ops``); one that ended inside its
    # start on the issuing thread is taken by ``_start_now`` instead.

    def _wrap(self, handle: Handle[Any], error: BaseException) -> CollectiveError:
        """A backend's ``error`` for ``handle``'s op, as the op's ``CollectiveError``."""
        context = self.context(handle.op, handle.seq, handle.timeout)
        return reports.failed(context, error, self.backend.explain(error))

    def complete(self, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
        """The backend op behind ``handle`` has ended (its tensors are free)."""
        if error is not None and self.checks_order and not isinstance(error, GangError):
            # Rule 8: held while order checks are open; as an agang error, not held again.
            error = self._wrap(handle, error)
            if self._checks.op_failed(functools.partial(self.complete, handle, value, error)):
                return
        now = time.monotonic()
        seconds = now - handle.issued_at
        # A handle that already failed (its deadline passed) records as timed out.
        timed_out = isinstance(error_of(handle), GangTimeoutError)
        outcome = "timed out" if timed_out else ("ok" if error is None else "failed")
        with self.lock:
            entry = self._scheduler.finish(handle.seq, seconds=seconds, outcome=outcome)
            room_waiters = self._room.wake()
            ordered_early = self._ordered_early
            if ordered_early and handle.seq in ordered_early:
                ordered_early.discard(handle.seq)
                if error is None:
                    self._counters.completed(handle.op, seconds)
                counted = False  # its handle finished when ordered: nothing more to count
            else:
                # The common end: a success whose entry just left the core, so no deadline
                # or break can fail its handle any more: it is counted now, before it
                # finishes (a waiter that finds it done sees it counted), not in a ``then``.
                counted = (
                    error is None
                    and entry is not None
                    and not entry.expired
                    and self.broken is None
                    and not self.closed
                    and not settled(handle)
                )
                if counted:
                    self._counters.completed(handle.op, seconds)
        for waiter in room_waiters:
            finish(waiter, None, None)
        if counted:
            finish(handle, value, None)
        elif error is None:

            def count_completed() -> None:
                with self.lock:
                    self._counters.completed(handle.op, time.monotonic() - handle.issued_at)

            finish(handle, value, None, then=count_completed)
        else:
            if isinstance(error, GangBrokenError | GangClosedError | CollectiveError):
                wrapped: BaseException = error
            else:
                wrapped = self._wrap(handle, error)

            def count_failed_and_break() -> None:
                with self.lock:
                    self._counters.num_failed += 1
                self.break_gang(wrapped)

            # Broken before the waiters wake: their next call must be refused (rule 6).
            finished = finish(handle, None, wrapped, then=count_failed_and_break)
            if not finished and not isinstance(error, GangBrokenError | GangClosedError):
                # Timed out (on_timeout="raise"), then failed in c10d: unusable all the same.
                self.break_gang(wrapped)
        if self._scheduler.num_queued:
            self._drain()

    def ordered(self, handle: Handle[Any], value: Any) -> None:
        """The op behind ``handle`` is ordered on the caller's stream (rule 10)."""
        with self.lock:
            self._ordered_early.add(handle.seq)
        finish(handle, value, None)

    # ---- Failure and closing (rules 6 and 7) ----

    def _take_pending(self) -> tuple[list[Any], list[tuple[Handle[Any], Done]]]:
        """The pending handles, room waiters and never-started ops (now dropped); the caller
        holds the lock, has marked the gang broken or closed, and fails them unlocked."""
        items = [entry.item for entry in self._scheduler.entries.values()]
        dropped = [entry.item for entry in self._scheduler.drop_queued()]
        pending: list[Any] = [handle for handle, _ in items if not settled(handle)]
        self._counters.num_failed += len(pending)
        started = any(e.started for e in self._scheduler.entries.values())
        self._ops_left_in_backend = started or self._checks.any_open()  # checks run there too
        pending.extend(self._room.wake())  # they fail with the others, and re-check
        return pending, dropped

    def break_gang(self, cause: BaseException) -> None:
        """Marks the gang broken by ``cause``, fails what is pending, aborts the backend."""

        with self.lock:
            if self.broken is not None or self.closed:
                return
            self.broken = cause
            pending, dropped = self._take_pending()
        # The cause is raised to the op's waiter, and every later call raises it again: a
        # library logs no ERROR for what it raises (a handled deadline printed twice).
        log.info("Gang '%s' (rank %d) is broken: %s", self.name, self.rank, cause)
        for future in pending:
            finish(future, None, reports.abandoned(future, self.name, cause))
        for handle, abandon in dropped:
            # Releases their tensors; nothing was started.
            abandon(reports.abandoned(handle, self.name, cause))
        self._checks.drop()  # after: what was held ends ops that the break failed already
        try:
            # A woken waiter may have closed it meanwhile: backends cope with abort after release.
            # A rank whose own deadline broke the gang tells its peers why (their ops
            # fail next, on connections it closes).
            reason = str(cause) if isinstance(cause, GangTimeoutError) else None
            self.backend.abort(reason)
        except Exception:
            log.exception("Aborting the communicator of gang '%s' failed.", self.name)

    def mark_closed(self) -> bool:
        """Closes the gang at once, failing pending waiters (rule 7); False if closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            pending, dropped = self._take_pending()
        self._alarm.disarm()  # no deadline is left to check (rule 7)
        for future in pending:
            finish(
                future,
                None,
                GangClosedError(f"{future} was pending when gang '{self.name}' was closed."),
            )
        for handle, abandon in dropped:
            abandon(GangClosedError(f"{handle} was pending when gang '{self.name}' was closed."))
        self._checks.drop()  # after: what was held ends ops that the close failed already
        return True

    def mark_inherited(self, error: GangInheritedError) -> None:
        """In a forked child: closed, and every use raises ``error`` (``agang._runtime.fork``);
        without the lock, which a parent thread may have held at the fork."""
        self.broken = error
        self.closed = True

    # ---- What a handle tells its owner (``agang._handle.HandleOwner``; rule 11) ----

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

    async def settle(self, handle: Handle[Any]) -> None:
        await self._polling.settle(handle)

    def park_for(self, handle: Handle[Any]) -> None:
        self._polling.park_for(handle)

    # ---- What the deadline check asks (rule 5; ``deadlines.Expiring``) ----

    def reap(self, now: float) -> float | None:
        return self._polling.reap(now) if self.polls else None

    def late(self, now: float, lag: float | None) -> tuple[list[Entry], float | None]:
        with self.lock:
            if lag is not None:
                self._counters.lags.append(lag)
            return self._scheduler.due(now), self._scheduler.next_deadline()

    def report_in_flight(self, now: float, skip: int) -> tuple[list[str], list[str]]:
        with self.lock:
            in_flight = self._scheduler.describe_in_flight(now, skip=skip)
            recent = [record.describe() for record in self._scheduler.recent()]
        return in_flight, recent

    def is_ordered_only(self, seq: int) -> bool:
        with self.lock:
            return seq in self._ordered_early

    def count_timed_out(self) -> None:
        with self.lock:
            self._counters.num_timed_out += 1

    # ---- Blame (rule 5): where this rank stands, when a peer's deadline asks ----

    def progress(self, number: int, collective: bool = False) -> Progress:
        """Where this rank stands on op ``number``: a sequence number, or with
        ``collective`` a number among the gang's collectives, which a peer asks by since
        it is the same op on every rank (rule 5)."""
        with self.lock:
            state: State = "closed" if self.closed else "open" if self.broken is None else "broken"
            waiting, asked_op, fingerprint = self._scheduler.standing(number, collective)
            return Progress(
                asked=number,
                issued=self._next_seq - 1,
                op=self._last_op,
                waiting=waiting,
                num_in_flight=len(self._scheduler.entries),
                state=state,
                asked_op=asked_op,
                asked_call=reports.call_of(fingerprint),
                collective=self._next_collective - 1 if collective else None,
            )

    # ---- Lifecycle and statistics (rule 7) ----

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

    def count_coalesced(self, num_members: int) -> None:
        with self.lock:
            self._counters.num_coalesced += num_members
