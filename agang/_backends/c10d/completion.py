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
   is one Work per transfer there (Gloo cannot coalesce), done once all of them are.
3. *NCCL*: the Work's future completes when the kernel is *queued*, and agang wants
   "finished on the device" for ``await``, without spinning a CPU core:

   a. At issue, the gang's own side stream is made to wait for the op (``work.wait()``
      under that stream: no CPU block), and a blocking-sync event is recorded on it. The
      caller's current stream is not touched, so compute queued after the call overlaps
      the communication.
   b. The gang's watcher (a ``SerialWaiter`` too) takes the events in issue order and
      calls ``event.synchronize()``, which sleeps in the driver with the GIL released,
      then asks the runtime whether the op failed (``DeviceRuntime.check_work``: NCCL's
      ``is_completed()`` is true for a failed op too and never raises) and reports
      ``done``.
   c. Side stream and watcher are the gang's, not the process's: one gang's op that
      waits for a late peer never holds back the report of another gang's finished op
      (ops of one communicator finish in order anyway, on its one NCCL stream).
   d. In stream-ordered mode the caller's current stream waits for the op instead and
      the op is reported *ordered* at once (``report_ordered``): ``await`` then means
      "ordered before later work on this stream", the cheap mode for callers who only
      need that. The watcher still learns when the op finished on the device and
      reports ``done`` then, so deadlines, errors, close and abort still see the op
      until it ends. A result bound for the host (``to_host``: object collectives read
      it on the CPU) is always watched to the end.
   e. An op's ``post`` (copying a flat result back into its members) is queued on the
      same stream right after the wait, before the event: it is part of what the event
      covers.

   Every stream, event and device call goes through the backend's ``DeviceRuntime``
   (torch.cuda, or a simulation in tests).

The Gloo waiter and the NCCL watcher are one class, ``SerialWaiter``: a thread, started
on first use, that takes a gang's ops in issue order, waits for each (``Work.wait()``
on Gloo; the event, then ``check_work``, on NCCL) and calls its ``done``. What differs
is only how one op is waited for, and that the NCCL watcher first makes the gang's GPU
its thread's device. A waiter ends once the gang releases its communicator (after the
ops queued before), or at exit (``agang._runtime.threads``: every waiter, so an idle
one of a gang never closed does not hold exit up); a forked child forgets the parent's.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar, final

import torch

from agang._backends.contract import Done, after_post, report_ordered
from agang._backends.cuda.runtime import DeviceEvent, DeviceRuntime
from agang._runtime import fork, threads

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
        self._stopped = False

    def watch(self, item: T, done: Done) -> None:
        """Calls ``done`` with the op's error (None on success) once ``wait(item)``
        returns, after every op watched before it; starts the thread on first use."""
        jobs = self._jobs
        if jobs is None:
            jobs = self._start()
        jobs.put((item, done))

    def _start(self) -> queue.SimpleQueue[tuple[T, Done] | None]:
        with self._lock:
            if self._jobs is None:
                jobs: queue.SimpleQueue[tuple[T, Done] | None] = queue.SimpleQueue()
                threads.start_daemon(functools.partial(self._run, jobs), name=self._name)
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
        self._transfers = SerialWaiter[Any](f"agang-wait {name} send/recv", _wait_for_work)
        self._watcher = SerialWaiter[tuple[DeviceEvent, Any, Completion]](
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
        finish = after_post(post, done)

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

    def watch_p2p(self, work: Any, done: Done) -> None:
        """Calls ``done`` once the send or recv behind ``work`` ended (rule 2 on Gloo)."""
        if self._nccl:
            self.watch(work, done)
            return
        self._transfers.watch(work, done)

    def _watch_on_device(
        self, work: Any, done: Done, post: Callable[[], None] | None, stream_ordered: bool
    ) -> None:
        runtime = self._runtime
        if stream_ordered:  # rule 3d
            current = runtime.current_stream(self._device)
            with runtime.use_stream(current):
                work.wait()  # the current stream waits; the CPU does not
            if post is not None:
                runtime.run_on(current, post)
            if not report_ordered(done):
                done(None)
                return
            post = None  # ran on the caller's stream; the side stream only watches
        stream = self._side_stream()
        with runtime.use_stream(stream):  # rule 3a
            work.wait()
        if post is not None:
            runtime.run_on(stream, post)  # rule 3e
        event = runtime.new_event()
        event.record(stream)
        self._watcher.watch((event, work, self), done)

    def _side_stream(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = self._runtime.side_stream(self._device, self._key)
            return self._stream

    def release(self) -> None:
        """Stops the waiters and drops the group: the gang frees it on its closing
        thread, and a reference kept here would keep it (and a store's port) alive past
        close."""
        for waiter in (self._collectives, self._transfers, self._watcher):
            waiter.stop()
        self._process_group = None


def _finished_on_device(item: tuple[DeviceEvent, Any, Completion]) -> BaseException | None:
    """Rule 3b: sleeps until the op's event completed, then asks whether it failed."""
    event, work, completion = item
    event.synchronize()
    group = completion._process_group  # None once released: the Work alone tells
    return completion._runtime.check_work(work, group, completion._device)
