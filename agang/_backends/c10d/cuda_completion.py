"""Learning that an NCCL op finished on the device, without spinning a CPU core.

NCCL's Work future completes when the kernel is *queued*. agang wants "finished on the
device" for ``await``, so, per gang (one ``Completion`` per ``C10dBackend``):
1. At issue, the gang's own side stream is made to wait for the op (``work.wait()``
   under that stream: no CPU block), and a blocking-sync event is recorded on it. The
   caller's current stream is not touched, so compute queued after the call overlaps the
   communication.
2. The gang's watcher thread takes the events in issue order and calls
   ``event.synchronize()``, which sleeps in the driver with the GIL released, then asks
   the runtime whether the op failed (``DeviceRuntime.check_work``: NCCL's
   ``is_completed()`` is true for a failed op too and never raises) and reports ``done``.
3. Side stream and watcher are the gang's, not the process's: one gang's op that waits
   for a late peer never holds back the report of another gang's finished op (ops of one
   communicator finish in order anyway, on its one NCCL stream). The watcher ends when
   the gang releases its communicator, or at exit.
4. In stream-ordered mode the caller's current stream waits for the op instead and the
   op is reported *ordered* at once (``report_ordered``): ``await`` then means "ordered
   before later work on this stream", the cheap mode for callers who only need that.
   The gang's watcher still learns when the op finished on the device and reports
   ``done`` then, so deadlines, errors, close and abort still see the op until it ends.
5. An op's ``post`` (copying a flat result back into its members) is queued on the same
   stream right after the wait, before the event: it is part of what the event covers.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from agang._backends.contract import report_ordered
from agang._backends.cuda.runtime import DeviceEvent, DeviceRuntime
from agang._runtime import fork, threads

Done = Callable[[BaseException | None], None]

_lock = threading.Lock()
_running: weakref.WeakSet[Completion] = weakref.WeakSet()


def _stop_all() -> None:
    with _lock:
        running = list(_running)
    for completion in running:
        completion.stop()


def _forget_in_child() -> None:
    # The watchers' threads are the parent's (``agang._runtime.fork``): the child stops none.
    global _lock, _running
    _lock = threading.Lock()
    _running = weakref.WeakSet()


threads.at_exit(stop=_stop_all)  # after the gangs closed and aborted their work
fork.on_fork_in_child(_forget_in_child)


class _Key:
    """A gang's key for its side stream: holds nothing, so the runtime holds nothing."""


class Completion:
    """One gang's side stream and watcher thread (rules 1 to 3), made on first use."""

    def __init__(
        self, runtime: DeviceRuntime, device: torch.device, process_group: Any, name: str
    ) -> None:
        self._runtime = runtime
        self._device = device
        self._process_group = process_group
        self._name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[DeviceEvent, Any, Done] | None] | None = None
        self._stream: Any = None
        self._key = _Key()
        self._stopped = False

    def watch(
        self, work: Any, done: Done, post: Callable[[], None] | None, *, stream_ordered: bool
    ) -> None:
        """Reports ``done`` once ``work`` has finished on the device (see the rules)."""
        runtime = self._runtime
        if stream_ordered:
            current = runtime.current_stream(self._device)
            with runtime.use_stream(current):
                work.wait()  # the current stream waits; the CPU does not
            if post is not None:
                runtime.run_on(current, post)
            if not report_ordered(done):
                done(None)
                return
            post = None  # ran on the caller's stream; the side stream only watches
        jobs, stream = self._start()
        with runtime.use_stream(stream):
            work.wait()
        if post is not None:
            runtime.run_on(stream, post)
        event = runtime.new_event()
        event.record(stream)
        jobs.put((event, work, done))

    def _start(self) -> tuple[queue.SimpleQueue[tuple[DeviceEvent, Any, Done] | None], Any]:
        with self._lock:
            if self._queue is None:
                self._stream = self._runtime.side_stream(self._device, self._key)
                self._queue = queue.SimpleQueue()
                jobs = self._queue
                threads.start_daemon(lambda: self._run(jobs), name=f"agang-nccl-watch {self._name}")
                with _lock:
                    _running.add(self)
            return self._queue, self._stream

    def stop(self) -> None:
        """Ends the watcher once the events queued before have been reported."""
        with self._lock:
            if self._queue is not None and not self._stopped:
                self._stopped = True
                self._queue.put(None)

    def release(self) -> None:
        """Stops the watcher and drops the group: the gang frees it on its closing thread,
        and a reference kept here would keep it (and a store's port) alive past close."""
        self.stop()
        self._process_group = None

    def _run(self, jobs: queue.SimpleQueue[tuple[DeviceEvent, Any, Done] | None]) -> None:
        self._runtime.bind_thread(self._device)
        while (item := jobs.get()) is not None:
            event, work, done = item
            try:
                event.synchronize()
                group = self._process_group  # None once released: the Work alone tells
                error = self._runtime.check_work(work, group, self._device)
            except Exception as exc:
                error = exc
            done(error)
        # The group is the backend's to free, on its closing thread: drop ours.
        self._process_group = None
