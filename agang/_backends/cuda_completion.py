"""Learning that an NCCL op finished on the GPU, without spinning a CPU core.

NCCL's Work future completes when the kernel is *queued*. agang wants "finished on the
device" for ``await``, so:
1. At issue, a per-device side stream is made to wait for the op (``work.wait()`` under
   that stream: no CPU block), and a blocking-sync CUDA event is recorded on it. The
   caller's current stream is not touched, so compute queued after the call overlaps the
   communication.
2. One watcher thread per process takes the events in issue order and calls
   ``event.synchronize()``, which sleeps in the driver with the GIL released, then asks
   the Work for errors (``is_completed`` raises if the op failed) and reports ``done``.
3. In stream-ordered mode the caller's current stream waits for the event instead and the
   op is reported done at once: ``await`` then means "ordered before later work on this
   stream", the cheap mode for callers who only need that.
4. An op's ``post`` (copying a flat result back into its members) is queued on the same
   stream right after the wait, before the event: it is part of what the event covers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from agang import _exit

Done = Callable[[BaseException | None], None]

_lock = threading.Lock()
_streams: dict[torch.device, Any] = {}
_watcher: _Watcher | None = None


class _Watcher:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Any, Done] | None] = queue.SimpleQueue()
        _exit.start_daemon(self._run, name="agang-cuda-watcher")
        _exit.add_stopper(self.stop)  # after the gangs closed and aborted their work

    def put(self, event: Any, work: Any, done: Done) -> None:
        self._queue.put((event, work, done))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, work, done = item
            try:
                event.synchronize()
                work.is_completed()  # raises if the op failed or was aborted
            except Exception as exc:
                done(exc)
            else:
                done(None)


def _side_stream(device: torch.device) -> Any:
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return stream


def _get_watcher() -> _Watcher:
    global _watcher
    with _lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


def watch(
    work: Any,
    device: torch.device,
    done: Done,
    post: Callable[[], None] | None,
    *,
    stream_ordered: bool,
) -> None:
    """Reports ``done`` once ``work`` has finished on ``device`` (see the rules above)."""
    if stream_ordered:
        current = torch.cuda.current_stream(device)
        with torch.cuda.stream(current):
            work.wait()  # the current stream waits; the CPU does not
            if post is not None:
                post()
        done(None)
        return
    stream = _side_stream(device)
    with torch.cuda.stream(stream):
        work.wait()
        if post is not None:
            post()
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(stream)
    _get_watcher().put(event, work, done)
