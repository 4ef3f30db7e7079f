"""The device runtime: every stream, event and device call the NCCL paths make.

``cuda_completion`` and ``C10dBackend``'s NCCL branches reach the device only through a
``DeviceRuntime``, chosen per backend: ``TorchCudaRuntime`` (torch.cuda) in production,
``agang.testing.SimulatedNccl``'s runtime in tests, so the real completion code runs on
a CPU against simulated streams.

What the completion path relies on:
1. Streams run their work in the order it was queued; ``use_stream`` makes a stream the
   thread's current one, so device work queued inside (c10d's kernels, ``Work.wait()``'s
   wait) is ordered on it.
2. ``run_on(stream, fn)`` runs ``fn`` so that the device work it launches is ordered on
   ``stream`` (torch: ``fn`` runs now under the stream and its kernels are queued; a
   simulation may run ``fn`` when the stream reaches it).
3. An event recorded on a stream completes once everything queued there before it has
   executed; ``synchronize()`` blocks the calling thread until then (without spinning,
   on a blocking-sync CUDA event), ``query()`` says whether it has.
4. NCCL's ``Work.is_completed()`` is true once the op finished *or failed*, and never
   raises: an asynchronous NCCL error or a c10d timeout is only seen through
   ``Work.exception()`` and the communicator's error state, which ``check_work`` reads
   once the op's event has completed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class DeviceEvent(Protocol):
    """A marker in a stream (rule 3)."""

    def record(self, stream: Any) -> None:
        """Places the marker at the current end of ``stream``."""

    def synchronize(self) -> None:
        """Blocks until everything queued before the marker has executed."""

    def query(self) -> bool:
        """Whether everything queued before the marker has executed."""


class DeviceRuntime(Protocol):
    """Streams, events and device state of one process (or one simulated rank)."""

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device``."""

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Makes ``stream`` the calling thread's current stream inside the block."""

    def side_stream(self, device: torch.device, key: object) -> Any:
        """A stream of agang's own on ``device``, one per ``key``, made on first use; it
        may be dropped once ``key`` (weakly referenced) is gone."""

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        """Runs ``fn`` with its device work ordered on ``stream`` (rule 2)."""

    def new_event(self) -> DeviceEvent:
        """A new event whose ``synchronize`` blocks without spinning."""

    def bind_thread(self, device: torch.device) -> None:
        """Makes ``device`` the calling thread's device (for agang's own threads)."""

    def check_work(
        self, work: Any, process_group: Any, device: torch.device
    ) -> BaseException | None:
        """The error of ``work`` once its event completed, or None if it succeeded (rule 4).

        ``process_group`` is None once the gang released it: then only the Work tells.
        """


class TorchCudaRuntime:
    """The production runtime: torch.cuda."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Weak keys: a gang's stream goes with the gang.
        self._side_streams: weakref.WeakKeyDictionary[object, dict[torch.device, Any]] = (
            weakref.WeakKeyDictionary()
        )

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def side_stream(self, device: torch.device, key: object) -> Any:
        with self._lock:
            streams = self._side_streams.setdefault(key, {})
            stream = streams.get(device)
            if stream is None:
                stream = streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            return stream

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def new_event(self) -> DeviceEvent:
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def bind_thread(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    def check_work(
        self, work: Any, process_group: Any, device: torch.device
    ) -> BaseException | None:
        # ``Work.exception()`` is deprecated in torch (it prints a note once), but it is
        # the one way to read a WorkNCCL's error without a stream wait; the
        # communicator's error state is set before the watchdog aborts it, which covers
        # ops on the same communicator that finished before the watchdog flagged them.
        try:
            error = work.exception()
        except Exception as exc:  # some Work types raise their error here
            return exc
        if error is not None:
            return error  # type: ignore[no-any-return]
        if process_group is None:
            return None
        try:
            backend_error = process_group._get_backend(device).get_error()
            failed = backend_error != type(backend_error).SUCCESS
        except Exception:
            return None  # no error state to read on this torch or backend
        if failed:
            return RuntimeError(f"The NCCL communicator reports an error: {backend_error}.")
        return None


_default: TorchCudaRuntime | None = None


def torch_runtime() -> TorchCudaRuntime:
    """The process's one ``TorchCudaRuntime`` (its side streams are shared by key)."""
    global _default
    if _default is None:
        _default = TorchCudaRuntime()
    return _default
