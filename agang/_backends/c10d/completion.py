"""How an op's end reaches agang on c10d, every way, in one file.

``C10dBackend`` hands each op's Work to its ``Completion`` (``watch`` for collectives,
``watch_p2p`` for transfers), which calls the op's ``done`` once the op ended, by one
of three roads:

1. *Gloo collectives*: the Work's future; its callback runs on a Gloo worker thread (or
   inline when the Work is already done). It only finishes the op's post-processing and
   calls ``done``.
2. *Gloo Work with no future* (send, recv and reduce_scatter: "Work::getFuture not
   implemented"): a ``SerialWaiter`` per gang and kind calls ``wait()`` on them in issue
   order. A later op that finishes before an earlier one is reported after it: late,
   never wrong. A recv that waits for its peer must not hold back the report of a
   finished collective, so transfers and collectives never share a waiter. An exchange
   is one Work per transfer there (Gloo cannot coalesce), done once all of them are:
   one job of the waiter waits for them all, so the op wakes it once.
3. *NCCL*: the Work's future completes when the kernel is *queued*, and agang wants
   "finished on the device" for ``await``. No host thread learns that for free, and
   handing an op to a thread that sleeps until the device is done, then back to the
   loop, costs more than a small op itself (sleeping threads woken, twice, and the GIL
   passed between them). So the NCCL road is "poll on the loop, park on a thread":

   a. *Issue is the c10d call.* An op is put in the gang's queue of unreported ops with
      its Work, nothing else: no stream context, no event, no thread. The caller's
      stream is not touched, so compute queued after the call overlaps the op.
   b. *Poll.* ``poll()`` reads, on the calling thread, the head of that queue:
      ``Work.is_completed()`` is a non-blocking query of c10d's own end event, true once
      the op finished *or failed* (it never raises). Each op found ended is reported:
      the runtime says whether it failed (``DeviceRuntime.check_work``), then ``done``.
      The engine polls at each issue and while a task awaits an op, on the task's loop,
      so an awaited op that ends soon is learned on the loop's own thread.
   c. *Park.* ``park(issued_before)`` hands the older ops still unreported to the gang's
      watcher (a ``SerialWaiter``): on its thread the gang's side stream waits for the
      op (``work.wait()`` under that stream), a blocking-sync event from the gang's pool
      is recorded there and ``synchronize()`` sleeps in the driver, GIL released; then
      ``check_work`` and ``done``. The engine parks an awaited op whose budget passed,
      the ops a plain thread waits for, and ops nobody awaits once they have run longer
      than its park delay; release and abort park everything.
   d. Queue, side stream and watcher are the gang's, not the process's: one gang's op
      that waits for a late peer never holds back another gang's (ops of one
      communicator finish in order anyway, on its one NCCL stream, so the queue is read
      from its head).
   e. In stream-ordered mode the caller's current stream waits for the op at issue
      (``work.wait()``, one stream wait, no context) and the op is reported *ordered*
      at once (``report_ordered``): ``await`` then means "ordered before later work on
      this stream". It is queued as in (a), so that its end on the device is learned
      lazily, by the next poll or park, and deadlines, errors, close and abort still
      see the op until it ends. A result bound for the host (``to_host``: object
      collectives read it on the CPU) is always learned at its end.
   f. An op's ``post`` (copying a flat result back into its members) must run on the
      device after the op and before it is reported: it is queued on the side stream
      right after the op (``work.wait()`` under it), and a pooled event recorded after
      it stands for the op in the queue (``query()`` for a poll, ``synchronize()`` once
      parked).

   Every stream, event and device call goes through the backend's ``DeviceRuntime``
   (torch.cuda, or a simulation in tests).

4. *Gloo ops an abort did not end.* A Gloo send caught mid-write (its bytes partly in
   the socket, the rest queued on the pair) is not failed when its pair closes: Gloo
   fails the pair's other pending ops, but not that one, so neither an abort nor the
   peer's death ends it, only c10d's own timeout (``tests/gloo/test_abort_stuck_send.py``:
   a 64 MiB broadcast to a stopped or killed peer was still running 3 s after the
   abort). Every Gloo op is noted until it is reported; at release after an abort, what
   is still noted once the others' ends came is reported failed: its group's
   connections are closed, so it moves no byte any more, and its memory is free.
   Its real end, if c10d ever reports it, is ignored.

The Gloo waiter and the NCCL watcher are one class, ``SerialWaiter``: a thread, started
on first use, that takes a gang's ops in issue order, waits for each (``Work.wait()``
on Gloo; the side stream's wait and an event, then ``check_work``, on NCCL) and calls
its ``done``. Each op handed to one is a thread hand-off (``agang._runtime.handoffs``). What differs
is only how one op is waited for, and that the NCCL watcher first makes the gang's GPU
its thread's device. A waiter ends once the gang releases its communicator (after the
ops queued before), or at exit (``agang._runtime.threads``: every waiter, so an idle
one of a gang never closed does not hold exit up); a forked child forgets the parent's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar, final

import torch

from agang._backends.contract import Done, after_post, countdown, report_ordered
from agang._backends.cuda.runtime import DeviceEvent, DeviceRuntime
from agang._runtime import fork, handoffs, threads

log = logging.getLogger("agang.c10d")

T = TypeVar("T")

_lock = threading.Lock()
_running: weakref.WeakSet[SerialWaiter[Any]] = weakref.WeakSet()


def _stop_all() -> None:
    with _lock:
        running = list(_running)
    for waiter in running:
        waiter.stop()


def _forget_in_child() -> None:
    # The waiters' threads are the parent's (``agang._runtime.fork``): the child stops none.
    global _lock, _running
    _lock = threading.Lock()
    _running = weakref.WeakSet()


threads.at_exit(stop=_stop_all)  # after the gangs closed and aborted their work
fork.on_fork_in_child(_forget_in_child)


@final
class SerialWaiter(Generic[T]):
    """A thread that waits for a gang's ops in issue order and reports each one's end.

    Args:
        name: The thread's name.
        wait: Waits for one op (an item given to ``watch``) to end; returns or raises
            the op's error, None on success. It runs on the waiter's thread.
        on_start: Runs first on the waiter's thread (the NCCL watcher binds its device).

    ``wait`` should not hold the gang's objects beyond the item: the waiter lives as long
    as its thread, and what it holds would too.
    """

    def __init__(
        self,
        name: str,
        wait: Callable[[T], BaseException | None],
        *,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
        self._wait = wait
        self._on_start = on_start
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[T, Done] | None] | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, item: T, done: Done) -> None:
        """Calls ``done`` with the op's error (None on success) once ``wait(item)``
        returns, after every op watched before it; starts the thread on first use."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._start()
        handoffs.count_handoff()
        jobs.put((item, done))

    def _start(self) -> queue.SimpleQueue[tuple[T, Done] | None]:
        with self._lock:
            if self._jobs is None:
                jobs: queue.SimpleQueue[tuple[T, Done] | None] = queue.SimpleQueue()
                self._thread = threads.start_daemon(
                    functools.partial(self._run, jobs), name=self._name
                )
                self._jobs = jobs
                with _lock:
                    _running.add(self)
            return self._jobs

    def stop(self) -> None:
        """Ends the thread once the ops watched before have been reported."""
        with self._lock:
            if self._jobs is not None and not self._stopped:
                self._stopped = True
                self._jobs.put(None)

    def join(self, seconds: float) -> None:
        """Waits, ``seconds`` at most, for a stopped waiter to report what it held."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(seconds)

    def _run(self, jobs: queue.SimpleQueue[tuple[T, Done] | None]) -> None:
        if self._on_start is not None:
            self._on_start()
        while (job := jobs.get()) is not None:
            item, done = job
            try:
                error = self._wait(item)
            except Exception as exc:
                error = exc
            done(error)


def _wait_for_work(work: Any) -> None:
    work.wait()  # raises c10d's error, if any


def _wait_for_works(works: list[Any]) -> BaseException | None:
    """Waits for each of ``works`` in turn, the ones after a failed one too (the op has
    ended once they all did); the first error, if any."""
    first: BaseException | None = None
    for work in works:
        try:
            work.wait()
        except Exception as exc:
            first = first or exc
    return first


class _Key:
    """A gang's key for its side stream: holds nothing, so the runtime holds nothing."""


@final
class Completion:
    """How one ``C10dBackend`` learns that its ops ended (the module's rules).

    Args:
        process_group: The gang's group (NCCL's ``check_work`` reads its error state).
        device: Where the ops' tensors live.
        kind: ``"gloo"`` or ``"nccl"``.
        name: The gang's name, in the waiters' thread names.
        stream_ordered: NCCL: report an op done once it is ordered before later work on
            the caller's stream (rule 3d).
        runtime: The device runtime of the NCCL road.
    """

    def __init__(
        self,
        process_group: Any,
        *,
        device: torch.device,
        kind: str,
        name: str,
        stream_ordered: bool,
        runtime: DeviceRuntime,
    ) -> None:
        self._process_group = process_group
        self._device = device
        self._nccl = kind == "nccl"
        self._stream_ordered = stream_ordered
        self._runtime = runtime
        self._lock = threading.Lock()
        self._stream: Any = None  # the NCCL side stream, made on first use (rule 3a)
        self._key = _Key()
        # Rule 2: transfers and collectives never share a waiter; threads start on use.
        self._collectives = SerialWaiter[Any](f"agang-wait {name} collectives", _wait_for_work)
        self._transfers = SerialWaiter[list[Any]](f"agang-wait {name} send/recv", _wait_for_works)
        self._unreported: deque[_Unreported] = deque()  # rule 3a
        self._open: dict[int, Done] = {}  # Gloo ops not reported yet (rule 4)
        self._reported = threading.Condition(self._lock)
        self._numbers = itertools.count()
        self._events = _EventPool(runtime)
        self._watcher = SerialWaiter[tuple[_Unreported, Completion]](
            f"agang-nccl-watch {name}",
            _finished_on_device,
            on_start=functools.partial(runtime.bind_thread, device),
        )

    def watch(
        self,
        work: Any,
        done: Done,
        post: Callable[[], None] | None = None,
        *,
        to_host: bool = False,
    ) -> None:
        """Calls ``done`` once the collective behind ``work`` ended, ``post`` (if any)
        having run first on success; ``to_host``: its result is read on the CPU."""
        if self._nccl:
            self._watch_on_device(work, done, post, self._stream_ordered and not to_host)
            return
        finish = after_post(post, self._noted(done))

        def on_future(future: Any) -> None:
            try:
                future.value()  # raises c10d's error, if any
            except Exception as exc:
                finish(exc)
            else:
                finish(None)

        try:
            future = work.get_future()
        except RuntimeError:
            # Gloo's reduce_scatter Work has no future ("Work::getFuture not implemented").
            self._collectives.watch(work, finish)
            return
        future.add_done_callback(on_future)

    def watch_p2p(self, works: list[Any], done: Done) -> None:
        """Calls ``done`` once the sends and recvs behind ``works`` (one op's) all ended,
        with the first error, if any (rule 2 on Gloo: one job of the waiter for them
        all, not one each: an exchange of 16 transfers woke it 16 times)."""
        if self._nccl:
            each = countdown(len(works), done)
            for work in works:
                self.watch(work, each)
            return
        self._transfers.watch(works, self._noted(done))

    def _noted(self, done: Done) -> Done:
        """``done``, noted until it is called: once, by the op's end or after an abort."""
        number = next(self._numbers)
        with self._lock:
            self._open[number] = done

        def report(error: BaseException | None) -> None:
            with self._lock:
                taken = self._open.pop(number, None)
                if not self._open:
                    self._reported.notify_all()
            if taken is not None:
                taken(error)

        return report

    def settle_after_abort(self, name: str, seconds: float) -> None:
        """After gang ``name``'s abort: waits ``seconds`` at most for the aborted ops'
        ends (the waiters' and the futures'), then reports the Gloo ops still noted
        failed (rule 4)."""
        give_up_at = time.monotonic() + seconds
        self.join(seconds)
        with self._lock:
            while self._open and (left := give_up_at - time.monotonic()) > 0:
                self._reported.wait(left)
            stuck, self._open = list(self._open.values()), {}
        if not stuck:
            return
        why = (
            f"gang '{name}' was closed after an abort that did not end this op (a Gloo send "
            "caught mid-write runs until c10d's own timeout); its connections are closed, "
            "so it moves no more bytes"
        )
        for done in stuck:
            done(RuntimeError(why))
        log.info(
            "agang: %d op(s) of gang '%s' outlived its abort: reported failed, their memory "
            "free again (Gloo ends them at its own timeout).",
            len(stuck),
            name,
        )

    def _watch_on_device(
        self, work: Any, done: Done, post: Callable[[], None] | None, stream_ordered: bool
    ) -> None:
        runtime = self._runtime
        event: DeviceEvent | None = None
        if stream_ordered:  # rule 3e
            work.wait()  # the caller's current stream waits; the CPU does not
            if post is not None:
                runtime.run_on(runtime.current_stream(self._device), post)
            if not report_ordered(done):
                done(None)
                return
        elif post is not None:  # rule 3f
            stream = self._side_stream()
            with runtime.use_stream(stream):
                work.wait()
            runtime.run_on(stream, post)
            event = self._events.take()
            event.record(stream)
        entry = _Unreported(time.monotonic(), work, event, done)
        with self._lock:
            self._unreported.append(entry)

    def poll(self) -> None:
        """Reports, here and now, the ops at the head of the queue that ended (rule 3b)."""
        unreported = self._unreported
        if not unreported:  # the usual case, read without the lock
            return
        ended = []
        with self._lock:
            while unreported and unreported[0].ended():
                ended.append(unreported.popleft())
        for entry in ended:
            self._report(entry)

    def park(self, issued_before: float = math.inf) -> float | None:
        """Hands the ops issued before ``issued_before`` to the watcher (rule 3c);
        returns when the oldest op left was issued, or None."""
        unreported = self._unreported
        if not unreported:
            return None
        with self._lock:
            parked = []
            while unreported and unreported[0].issued_at < issued_before:
                parked.append(unreported.popleft())
            oldest = unreported[0].issued_at if unreported else None
        for entry in parked:
            self._watcher.watch((entry, self), entry.done)
        return oldest

    def _report(self, entry: _Unreported) -> None:
        error = self._runtime.check_work(entry.work, self._process_group, self._device)
        if entry.event is not None:
            self._events.give(entry.event)
        entry.done(error)

    def _side_stream(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = self._runtime.side_stream(self._device, self._key)
            return self._stream

    def release(self) -> None:
        """Parks what is unreported (its ``done`` still comes), stops the waiters once
        they reported what they hold, and drops the group: the gang frees it on its
        closing thread, and a reference kept here would keep it (and a store's port)
        alive past close."""
        self.park()
        for waiter in (self._collectives, self._transfers, self._watcher):
            waiter.stop()
        self._process_group = None

    def join(self, seconds: float) -> None:
        """Waits, ``seconds`` at most in all, for the stopped waiters to report every op
        they held: once the work was aborted, its ends come soon, and a gang closed
        with an op pending then returns with the op's memory free again."""
        give_up = time.monotonic() + seconds
        for waiter in (self._collectives, self._transfers, self._watcher):
            waiter.join(max(0.0, give_up - time.monotonic()))


@final
class _Unreported:
    """An NCCL op whose end has not been reported yet (rule 3a): its Work, and the event
    that stands for it where a ``post`` runs after it (rule 3f)."""

    __slots__ = ("done", "event", "issued_at", "work")

    def __init__(self, issued_at: float, work: Any, event: DeviceEvent | None, done: Done):
        self.issued_at = issued_at
        self.work = work
        self.event = event
        self.done = done

    def ended(self) -> bool:
        """Whether the op has ended on the device (finished or failed); never blocks."""
        event = self.event
        return bool(event.query() if event is not None else self.work.is_completed())


@final
class _EventPool:
    """Blocking-sync events, reused: making one per op costs a driver call, and destroying
    it another (rule 3)."""

    _MAX_KEPT = 64

    def __init__(self, runtime: DeviceRuntime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._free: list[DeviceEvent] = []

    def take(self) -> DeviceEvent:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._runtime.new_event()

    def give(self, event: DeviceEvent) -> None:
        """Returns an event whose marker the device has passed."""
        with self._lock:
            if len(self._free) < self._MAX_KEPT:
                self._free.append(event)


def _finished_on_device(item: tuple[_Unreported, Completion]) -> BaseException | None:
    """Rule 3c, on the watcher's thread: sleeps until the op ended on the device, then
    asks whether it failed."""
    entry, completion = item
    runtime = completion._runtime
    event = entry.event
    if event is None:  # the op's Work alone: order an event of ours after it
        stream = completion._side_stream()
        with runtime.use_stream(stream):
            entry.work.wait()
        event = completion._events.take()
        event.record(stream)
    event.synchronize()
    completion._events.give(event)
    group = completion._process_group  # None once released: the Work alone tells
    return runtime.check_work(entry.work, group, completion._device)
