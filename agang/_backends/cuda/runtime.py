"""The device runtime: every stream, event and device call the NCCL paths make.

``agang._backends.c10d.completion`` and ``C10dBackend`` reach the device only through a
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
   ``Work.exception()`` (unreadable from Python on some torch releases), the Work's
   result future (set by c10d's watchdog) and the communicator's error state, which
   ``check_work`` reads, without blocking, once the op's event has completed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from agang._backends.cuda.streams import PrivateStreams


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
        """A stream of agang's own on ``device``, one per ``key``, made on first use: no
        other code can be handed the same stream (``streams``); it may be dropped once
        ``key`` (weakly referenced) is gone."""

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        """Runs ``fn`` with its device work ordered on ``stream`` (rule 2)."""

    def new_event(self) -> DeviceEvent:
        """A new event whose ``synchronize`` blocks without spinning."""

    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        """Makes ``stream`` wait for ``event`` (device side: the CPU does not block)."""

    def bind_thread(self, device: torch.device) -> None:
        """Makes ``device`` the calling thread's device (for agang's own threads)."""

    def check_work(
        self, work: Any, process_group: Any, device: torch.device
    ) -> BaseException | None:
        """The error of ``work`` once its event completed, or None if it succeeded (rule 4).

        ``process_group`` is None once the gang released it: then only the Work tells.
        """


class TorchCudaRuntime:
    """The production runtime: torch.cuda.

    Args:
        streams: Makes the side streams (private ones, outside torch's pool; tests pass a
            double).
    """

    def __init__(self, streams: PrivateStreams | None = None) -> None:
        self._streams = PrivateStreams() if streams is None else streams
        self._lock = threading.Lock()
        self._exception_readable = True
        self._result_readable = True
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
                stream = streams[device] = self._streams.new(device, key)
            return stream

    def run_on(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def new_event(self) -> DeviceEvent:
        return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]

    def wait_event(self, stream: Any, event: DeviceEvent) -> None:
        stream.wait_event(event)

    def bind_thread(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)

    def check_work(
        self, work: Any, process_group: Any, device: torch.device
    ) -> BaseException | None:
        # Three places may hold the error of an op whose event completed; each is read
        # without blocking, and one this torch cannot give is skipped from then on.
        for read in (self._work_exception, self._work_result):
            error = read(work)
            if error is not None:
                return error
        return _communicator_error(process_group, device)

    def _work_exception(self, work: Any) -> BaseException | None:
        # ``Work.exception()`` is deprecated in torch (it prints a note once). On some
        # releases (torch 2.11, seen on an H100) its binding cannot hand the C++
        # exception to Python at all and raises TypeError whether or not the op failed:
        # that says nothing about the op, so the other two places are read instead.
        if not self._exception_readable:
            return None
        try:
            error = work.exception()
        except TypeError:
            self._exception_readable = False
            return None
        except Exception as exc:  # some Work types raise their error here
            return exc
        return error if isinstance(error, BaseException) else None

    def _work_result(self, work: Any) -> BaseException | None:
        # WorkNCCL's result future: c10d's watchdog sets it to SUCCESS, TIMEOUT or
        # COMM_ERROR once it saw the op end. Read only if already set: waiting for it
        # would add the watchdog's polling interval to every op.
        if not self._result_readable:
            return None
        try:
            future = work.get_future_result()
        except (AttributeError, RuntimeError):  # not this Work type, or this torch
            self._result_readable = False
            return None
        if not future.done():
            return None
        try:
            result = int(future.value())
        except Exception as exc:
            return exc
        if result == _WORK_SUCCESS:
            return None
        return RuntimeError(f"NCCL reports the op's result as {_work_result_name(result)}.")


_WORK_SUCCESS = 0  # c10d's WorkResult: SUCCESS 0, TIMEOUT 1, COMM_ERROR 2, UNKNOWN 100


def _work_result_name(value: int) -> str:
    names = {1: "TIMEOUT", 2: "COMM_ERROR", 100: "UNKNOWN"}
    return names.get(value, f"result {value}")


def _communicator_error(process_group: Any, device: torch.device) -> BaseException | None:
    # The communicator's error state is set before the watchdog aborts it, which covers
    # ops on the same communicator that finished before the watchdog flagged them.
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


class StreamOrder:
    """Orders a caller's device work around a gang's ops, on the caller's own streams.

    For code above the gang that queues device work of its own (``GradientSync``'s
    copies): each call acts on the calling thread's current stream, as torch's kernels do.

    Args:
        runtime: The gang's device runtime.
        device: The gang's device.
        stream_ordered: Whether the gang reports ops once ordered on the issuing
            thread's current stream (then only that stream waits for them).
    """

    def __init__(self, runtime: DeviceRuntime, device: torch.device, *, stream_ordered: bool):
        self._runtime = runtime
        self._device = device
        self.stream_ordered = stream_ordered

    def current(self) -> Any:
        """The calling thread's current stream."""
        return self._runtime.current_stream(self._device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Makes ``stream`` current inside the block."""
        return self._runtime.use_stream(stream)

    def run_here(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` with its device work ordered on the current stream."""
        self._runtime.run_on(self.current(), fn)

    def mark(self) -> DeviceEvent:
        """An event at the current end of the current stream."""
        event = self._runtime.new_event()
        event.record(self.current())
        return event

    def wait(self, event: DeviceEvent) -> None:
        """Makes the current stream wait for ``event``."""
        self._runtime.wait_event(self.current(), event)


_default: TorchCudaRuntime | None = None


def torch_runtime() -> TorchCudaRuntime:
    """The process's one ``TorchCudaRuntime`` (its side streams are shared by key)."""
    global _default
    if _default is None:
        _default = TorchCudaRuntime()
    return _default
