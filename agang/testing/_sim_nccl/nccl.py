"""``SimulatedNccl``: agang's real NCCL code paths, run on a CPU against simulated devices."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from agang._backends.c10d.backend import C10dBackend
from agang._backends.sim_nccl.device import SimDevice, SimEvent, SimStream, Stall
from agang._backends.sim_nccl.group import Communicator, SimProcessGroup, SimRuntime
from agang._collective.gang import gang_over
from agang._collective.process_group_gang import ProcessGroupGang
from agang._policy import OnTimeout, make_policy


class SimulatedNccl:
    """``size`` simulated NCCL ranks in one process, for testing asyncio code on a CPU.

    The gangs it makes are real ``agang.ProcessGroupGang`` objects with backend
    ``"nccl"``: agang's NCCL completion path (polled on the loop, parked on the gang's
    watcher thread, the error check) runs unchanged. Only the device is simulated:

    - Each rank has streams, FIFO queues of kernels, and events. A kernel runs as soon as
      it can, on the thread whose call made it runnable (a GPU needs no host thread); a
      device thread only times stalls and the watchdog. A collective's kernel runs only
      once every rank's kernel for it is at the head of its stream, as NCCL's kernels
      block until all peers joined.
    - Results are written when the kernel runs: reading a tensor before ``await`` may
      see the old data, as on a GPU.
    - Work behaves like NCCL's: done at enqueue, ``wait()`` orders the current stream
      without blocking (a raw barrier's ``wait()`` blocks), ``is_completed()`` never
      raises, errors are in ``exception()``; ``abort()`` makes pending kernels exit.
    - ``abort()`` (and ``shutdown()``) of a group blocks until the rank's device has
      reached the group's pending kernels, as NCCL's does: behind the rank's own long kernel
      ([`stall`][agang.testing.SimulatedNccl.stall]) it waits for the device to get past it; behind
      a peer that never comes it does not wait.

    Tensors are CPU tensors: the gangs' device is ``cpu``. All ranks run in this process,
    typically as tasks of one event loop. Lanes and sub-gangs are not simulated: call
    [`gangs`][agang.testing.SimulatedNccl.gangs] again for another communicator over the same ranks.

    Args:
        size: The number of ranks.
        watchdog_timeout: Seconds after which c10d's watchdog fails a pending op and
            aborts its communicator on that rank; None to use the timeout agang sets
            (far behind its own deadlines).

    Example:
        ```python
        import asyncio

        import torch

        from agang.testing import SimulatedNccl


        async def main():
            with SimulatedNccl(2) as sim:
                gangs = sim.gangs()  # one ProcessGroupGang per simulated rank
                results = await asyncio.gather(*(g.all_reduce(torch.ones(4)) for g in gangs))
            return [result.tolist() for result in results]


        assert asyncio.run(main()) == [[2.0] * 4] * 2
        ```
    """

    def __init__(self, size: int, *, watchdog_timeout: float | None = None) -> None:
        if size < 1:
            raise ValueError(f"`size` must be a positive int, but is {size!r} instead.")
        self._size = size
        self._device = SimDevice(watchdog_timeout=watchdog_timeout)
        self._runtimes = [SimRuntime(self._device, rank) for rank in range(size)]
        self._names = itertools.count()

    @property
    def size(self) -> int:
        """The number of simulated ranks."""
        return self._size

    def gangs(
        self,
        name: str | None = None,
        *,
        op_timeout: float | None = None,
        on_timeout: OnTimeout = "abort",
        stream_ordered: bool = False,
    ) -> list[ProcessGroupGang]:
        """One gang per rank (in rank order) over a new simulated communicator."""
        name = f"sim{next(self._names)}" if name is None else name
        policy = make_policy(op_timeout=op_timeout, on_timeout=on_timeout, check_order=False)
        communicator = Communicator(name, self._size)
        gangs = []
        for rank, runtime in enumerate(self._runtimes):
            group = SimProcessGroup(communicator, rank, runtime, self._device)
            backend = C10dBackend(
                group,  # type: ignore[arg-type]  # a duck-typed ProcessGroup
                device=torch.device("cpu"),
                kind="nccl",
                name=name,
                is_world=False,
                stream_ordered=stream_ordered,
                runtime=runtime,
                registered=False,
            )
            gangs.append(gang_over(ProcessGroupGang, backend, policy))
        return gangs

    def pause(self, rank: int) -> None:
        """Stops ``rank``'s device: none of its kernels runs (its peers' collectives
        with it wait) until [`resume`][agang.testing.SimulatedNccl.resume]. An abort on ``rank``
        itself with kernels pending waits for the resume too (its device never reaches them before).
        """
        self._device.pause(self._check_rank(rank))

    def resume(self, rank: int) -> None:
        """Lets ``rank``'s device run again."""
        self._device.resume(self._check_rank(rank))

    def fail_next(self, message: str = "simulated asynchronous NCCL error") -> None:
        """Makes the next collective to run fail on every rank, as an asynchronous NCCL
        error does: its kernels exit without writing outputs, its Work holds the error,
        and the communicator is left in an error state."""
        self._device.fail_next(message)

    def bound_threads(self, rank: int) -> list[str]:
        """The names of the threads that made ``rank``'s device theirs, in order (on a
        GPU: ``torch.cuda.set_device`` before touching it)."""
        return list(self._runtimes[self._check_rank(rank)].bound_threads)

    def synchronize(self, rank: int) -> None:
        """Blocks until everything queued so far on ``rank``'s current stream (of this
        thread) has run: ``torch.cuda.synchronize()`` for one simulated rank, for code
        that drives the process groups directly (``gang.process_group``)."""
        self.record_event(rank).synchronize()

    # Streams of the user's own, for code that orders its device work (torch.cuda's
    # ``Stream``, ``stream(s)``, a long kernel, ``Event().record()``).

    def stream(self, rank: int) -> SimStream:
        """A new stream of ``rank``, as ``torch.cuda.Stream()`` on that rank's GPU."""
        return self._device.new_stream(self._check_rank(rank), f"rank {rank} user")

    @contextlib.contextmanager
    def use_stream(self, rank: int, stream: SimStream) -> Iterator[None]:
        """Makes ``stream`` ``rank``'s current stream on this thread inside the block, as
        ``torch.cuda.stream(stream)`` does."""
        with self._runtimes[self._check_rank(rank)].use_stream(stream):
            yield

    def hold(self, rank: int) -> Callable[[], None]:
        """Holds ``rank``'s current stream (of this thread) until the returned function
        is called: stands in for long device work queued there, such as compute."""
        runtime = self._runtimes[self._check_rank(rank)]
        return self._device.hold(runtime.current_stream())

    def stall(self, rank: int, seconds: float) -> Stall:
        """Queues on ``rank``'s current stream (of this thread) a kernel that keeps it
        busy for ``seconds`` from when the device starts it, as ``torch.cuda._sleep``
        does on a GPU: the rank's own long device work. Its ``wait(timeout)`` blocks
        until the device got past it and returns that moment (``time.monotonic()``)."""
        if not seconds >= 0:
            raise ValueError(f"`seconds` must be >= 0, but is {seconds!r} instead.")
        runtime = self._runtimes[self._check_rank(rank)]
        return self._device.stall(runtime.current_stream(), seconds)

    def record_event(self, rank: int) -> SimEvent:
        """An event at the end of ``rank``'s current stream (of this thread): its
        ``query()`` says whether the stream got there, ``synchronize()`` waits for it."""
        runtime = self._runtimes[self._check_rank(rank)]
        event = runtime.new_event()
        event.record(runtime.current_stream())
        return event

    def close(self) -> None:
        """Stops the device thread; close the gangs first."""
        self._device.close()

    def __enter__(self) -> SimulatedNccl:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self._size:
            raise ValueError(f"`rank` must be in [0, {self._size}), but is {rank} instead.")
        return rank
