"""The simulated rank of ``SimulatedNccl``: its device runtime, its process groups (a
duck-typed ``ProcessGroup`` over NCCL) and their Work.

The group issues like ``ProcessGroupNCCL``: the communicator's own stream first waits for
the caller's current stream, then gets the op's kernel. Its Work behaves like
``WorkNCCL``:
1. The future is done at enqueue (it only means "queued").
2. ``wait()`` makes the caller's current stream wait for the op, without blocking the
   CPU; only a barrier's ``wait()`` blocks the calling thread until it completed.
3. ``is_completed()`` is true once the op finished *or failed*, and never raises; the
   error is in ``exception()`` and the group's error state (``get_error()``).
4. ``abort()`` makes this rank's pending kernels of the group exit with an error; new
   ops on an aborted or failed communicator fail when issued.
5. ``abort()`` returns only once this rank's device has reached every pending kernel of
   the group, and those kernels have exited. Work queued ahead of them on this rank
   (its own long kernels, a stall; what its streams wait for) runs first, so an abort
   behind it blocks the calling thread until the device got past it. A peer that never
   comes does not: the kernel waiting for it is what the abort ends. (Measured with
   NCCL 2.28 on an H100: an all-reduce queued behind 1.8 s of the rank's own kernel made
   ``abort()`` take 1.46 s.) ``shutdown()`` blocks the same way; the simulated group has
   no destroy of its own (it is not registered with ``torch.distributed``), and a real
   ``destroy_process_group`` waits as ``abort()`` does.
6. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is read when the group is made, as
   ``ProcessGroupNCCL`` reads it. Under 1 or 3 (c10d's "tear down") an asynchronous error
   or a watchdog timeout kills the process (SIGABRT), as c10d's watchdog does; under 0 or
   2 the error stays in the Work and the error state, and the process lives. Unset, it is
   taken as 2, the value ``agang.init`` sets where the user did not: the simulation
   stands for agang's set-up, and a test that wants c10d's own default sets 3.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.sim_nccl.device import (
    Collective,
    HostFn,
    Part,
    SimDevice,
    SimEvent,
    SimStream,
    WaitFor,
    Wire,
)
from agang._backends.sim_nccl.kernels import kernel_for
from agang._runtime import threads

log = logging.getLogger("agang.testing")

#: ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s values under which c10d tears the process down.
_TEAR_DOWN = ("1", "3")


class SimRuntime:
    """One simulated rank's streams and events: a ``DeviceRuntime`` for ``C10dBackend``."""

    def __init__(self, device: SimDevice, rank: int) -> None:
        self.rank = rank
        self.bound_threads: list[str] = []
        self._device = device
        self._default = device.new_stream(rank, f"rank {rank} default")
        self._local = threading.local()
        self._side: dict[tuple[torch.device, object], SimStream] = {}

    def current_stream(self, device: torch.device | None = None) -> SimStream:
        stream: SimStream | None = getattr(self._local, "stream", None)
        return self._default if stream is None else stream

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def side_stream(self, device: torch.device, key: object) -> SimStream:
        with self._device.cond:
            stream = self._side.get((device, key))
            if stream is None:
                name = f"rank {self.rank} side {len(self._side)}"
                stream = self._side[(device, key)] = self._device.new_stream(self.rank, name)
            return stream

    def run_on(self, stream: SimStream, fn: Callable[[], None]) -> None:
        self._device.enqueue(stream, HostFn(fn))

    def new_event(self) -> SimEvent:
        return SimEvent(self._device)

    def wait_event(self, stream: SimStream, event: Any) -> None:
        self._device.enqueue(stream, WaitFor(event))

    def bind_thread(self, device: torch.device) -> None:
        self.bound_threads.append(threading.current_thread().name)

    def check_work(
        self, work: Any, process_group: Any, device: torch.device
    ) -> BaseException | None:
        error = work.exception()
        if error is not None:
            return error  # type: ignore[no-any-return]
        if process_group is not None and process_group.get_error() != "SUCCESS":
            return dist.DistBackendError(
                f"The communicator is in error state {process_group.get_error()}."
            )
        return None


class SimWork(dist.Work):
    """The Work of one simulated NCCL op (rules 1 to 3): a ``dist.Work``, so that code
    which checks for one (torch's functional collectives, a user's) takes it."""

    def __init__(self, part: Part, runtime: SimRuntime, device: SimDevice, *, barrier: bool):
        super().__init__()
        self._part = part
        self._runtime = runtime
        self._device = device
        self._barrier = barrier
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(part.outputs)  # done at enqueue (rule 1)

    def wait(self, timeout: timedelta | None = None) -> bool:
        part = self._part
        if part.error is not None:
            raise part.error
        if self._barrier:
            # As NCCL's: a timeout (c10d's zero means none) that passes raises, here
            # without touching the communicator, which NCCL's watchdog may abort too.
            seconds = timeout.total_seconds() if timeout else None
            with self._device.cond:
                ended = self._device.cond.wait_for(
                    lambda: part.done or part.error is not None or self._device.closed,
                    timeout=seconds,
                )
            if part.error is not None:
                raise part.error
            if not ended:
                raise dist.DistBackendError(
                    f"The simulated barrier ran for {seconds:.3g} s before timing out: "
                    "not every rank of its communicator reached it."
                )
            return True
        self._device.enqueue(self._runtime.current_stream(), WaitFor(part))
        return True

    def is_completed(self) -> bool:
        return self._part.done or self._part.error is not None

    def is_success(self) -> bool:
        return self._part.done and self._part.error is None

    def exception(self) -> BaseException | None:
        return self._part.error

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    @property
    def part(self) -> Part:
        """The op's part on this rank."""
        return self._part

    def result(self) -> Any:
        return self._part.outputs


class Communicator:
    """What the ranks of one simulated communicator share: its ops, matched by order.
    Across processes each process has its own, and its ``wire`` carries the ops to the
    others."""

    def __init__(self, name: str, size: int, *, wire: Wire | None = None) -> None:
        self.name = name
        self.size = size
        self.wire = wire
        self.collectives: dict[Any, Collective] = {}
        self.counts: dict[Any, int] = {}


class SimProcessGroup:
    """One rank's view of a simulated NCCL communicator (rules 4 and 5, and the module's)."""

    def __init__(
        self, communicator: Communicator, rank: int, runtime: SimRuntime, device: SimDevice
    ) -> None:
        self._communicator = communicator
        self._rank = rank
        self._runtime = runtime
        self._device = device
        self._stream = device.new_stream(rank, f"rank {rank} nccl '{communicator.name}'")
        self._timeout: float | None = None
        self._error = "SUCCESS"
        self._aborted = False
        self._parts: list[Part] = []
        self.group_name = communicator.name
        self._group: list[Part] | None = None  # the parts of an open coalescing group
        # Rule 6: read once, when the group is made.
        self._tears_down = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2") in _TEAR_DOWN
        self._group_streams: dict[tuple[int, ...], SimStream] = {}

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._communicator.size

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def get_error(self) -> str:
        """``SUCCESS``, ``TIMEOUT`` or ``COMM_ERROR``: the communicator's error state."""
        return self._error

    def abort(self) -> None:
        """Rules 4 and 5: fails this rank's pending kernels of the group and blocks until
        they have exited (or the simulated device is closed)."""
        device = self._device
        with device.cond:
            self._aborted = True
            pending = [part for part in self._parts if not part.done]
            for part in pending:
                device.fail(part, dist.DistBackendError("NCCL communicator was aborted."))
            device.cond.wait_for(lambda: device.closed or all(p.done for p in pending))
        if self._communicator.wire is not None:
            self._communicator.wire.abort()

    def shutdown(self) -> None:
        self.abort()

    # Called by the device thread, with its lock held.

    def async_error(self, message: str) -> BaseException:
        self._error = "COMM_ERROR"
        self._tear_down_if_asked(f"NCCL error: {message}")
        return dist.DistBackendError(f"NCCL error: {message}")

    def watchdog_fired(self, timeout: float) -> None:
        self._tear_down_if_asked(f"watchdog caught a collective timeout ({timeout} s)")
        self._error = "TIMEOUT"
        error = dist.DistBackendError(
            f"Watchdog caught collective operation timeout ({timeout} s)."
        )
        for part in self._parts:
            self._device.fail(part, error)
        self._aborted = True
        wire = self._communicator.wire
        if wire is not None:  # not on the device thread, which holds the device's lock
            threads.start_daemon(wire.abort, name="agang-sim-nccl-watchdog-abort")

    def _tear_down_if_asked(self, why: str) -> None:
        """Rule 6: c10d's watchdog, under a tear-down mode, ends the process."""
        if self._tears_down:
            log.critical(
                "Simulated NCCL: rank %d of '%s': %s; TORCH_NCCL_ASYNC_ERROR_HANDLING tears "
                "the process down.",
                self._rank,
                self.group_name,
                why,
            )
            logging.shutdown()
            os.abort()

    # Issuing.

    def _issue(
        self,
        kind: str,
        inputs: Any,
        outputs: Any,
        *,
        key: Any = None,
        ranks: list[int] | None = None,
        options: Any = None,
        stream: SimStream | None = None,
    ) -> SimWork:
        """Issues one rank's part of an op on ``stream`` (the communicator's own by
        default), after the work on the caller's current stream."""
        stream = self._stream if stream is None else stream
        device = self._device
        with device.cond:
            if self._aborted or self._error != "SUCCESS":
                raise dist.DistBackendError(
                    f"NCCL communicator '{self._communicator.name}' was aborted or failed."
                )
            communicator = self._communicator
            key = ("collective",) if key is None else key
            index = communicator.counts.get((key, self._rank), 0)
            communicator.counts[(key, self._rank)] = index + 1
            everyone = list(range(communicator.size)) if ranks is None else ranks
            if communicator.wire is not None and everyone != [self._rank]:
                # Its other parts are in other processes: the wire meets them there.
                collective: Collective | None = Collective(
                    kind,
                    everyone,
                    kernel_for(kind, options),
                    options=options,
                    wire=communicator.wire,
                )
            else:
                collective = communicator.collectives.get((key, index))
            if collective is None:
                collective = Collective(kind, everyone, kernel_for(kind, options), options=options)
                communicator.collectives[(key, index)] = collective
            if collective.kind != kind:
                raise RuntimeError(
                    f"Simulated NCCL: rank {self._rank} issued {kind} where a peer issued "
                    f"{collective.kind} on '{communicator.name}'."
                )
            part = Part(collective, self._rank, inputs, outputs)
            part.timeout = self._timeout
            part.communicator = self
            part.index = index
            collective.parts[self._rank] = part
            if collective.wire is None and len(collective.parts) == len(collective.ranks):
                del communicator.collectives[(key, index)]
            self._parts = [p for p in self._parts if not p.done] + [part]
            # The communicator's stream waits for the caller's current stream first.
            marker = SimEvent(device)
            marker.record(self._runtime.current_stream())
            device.enqueue(stream, WaitFor(marker))
            device.enqueue(stream, part)
        return SimWork(part, self._runtime, device, barrier=kind == "barrier")

    def allreduce(self, tensors: list[torch.Tensor], options: Any = None) -> SimWork:
        return self._issue("allreduce", tensors, tensors, options=options)

    def broadcast(self, tensors: list[torch.Tensor], options: Any = None) -> SimWork:
        return self._issue("broadcast", tensors, tensors, options=options)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: Any = None
    ) -> SimWork:
        return self._issue("allgather", inputs, outputs)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, options: Any = None
    ) -> SimWork:
        return self._issue("all_gather_single", input, output)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, options: Any = None
    ) -> SimWork:
        return self._issue("reduce_scatter_single", input, output, options=options)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        options: Any = None,
    ) -> SimWork:
        return self._issue(
            "all_to_all_single",
            (input, list(input_split_sizes)),
            (output, list(output_split_sizes)),
        )

    def reduce(self, tensors: list[torch.Tensor], options: Any = None) -> SimWork:
        return self._issue("reduce", tensors, tensors, options=options)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], options: Any = None
    ) -> SimWork:
        return self._issue("gather", inputs, outputs, options=options)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], options: Any = None
    ) -> SimWork:
        return self._issue("scatter", inputs, outputs, options=options)

    def send(self, tensors: list[torch.Tensor], destination: int, tag: int = 0) -> SimWork:
        return self._point_to_point(tensors, None, [self._rank, destination])

    def recv(self, tensors: list[torch.Tensor], source: int, tag: int = 0) -> SimWork:
        return self._point_to_point(None, tensors, [source, self._rank])

    def _point_to_point(self, inputs: Any, outputs: Any, pair: list[int]) -> SimWork:
        """A send's or receive's part; matched per (source, destination) pair in order.
        Inside a coalescing group it runs on a stream of its own per pair and direction,
        so the group's transfers wait for their peers independently, as one NCCL group
        does, instead of one behind another on the communicator's stream."""
        stream = None
        if self._group is not None:
            stream = self._group_streams.get(tuple(pair))
            if stream is None:
                name = f"rank {self._rank} nccl '{self._communicator.name}' p2p {pair}"
                stream = self._group_streams[tuple(pair)] = self._device.new_stream(
                    self._rank, name
                )
        key, ranks = ("p2p", *pair), sorted(pair)
        work = self._issue("send", inputs, outputs, key=key, ranks=ranks, stream=stream)
        if self._group is not None:
            self._group.append(work.part)
        return work

    def _start_coalescing(self, device: Any) -> None:
        self._group = []

    def _end_coalescing(self, device: Any) -> SimWork:
        """One Work for the group: a part on the communicator's stream, after every
        transfer of the group, that fails with the first of their errors."""
        group, self._group = self._group or [], None
        with self._device.cond:
            for part in group:
                self._device.enqueue(self._stream, WaitFor(part))
        key = ("coalesced", self._rank)
        return self._issue("coalesced", None, None, key=key, ranks=[self._rank], options=group)

    def barrier(self, options: Any = None) -> SimWork:
        return self._issue("barrier", None, None)
