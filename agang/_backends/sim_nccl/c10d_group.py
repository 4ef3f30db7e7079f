"""``SimNcclProcessGroup``: a simulated NCCL communicator across processes, as a c10d
process group of the registered backend ``agang_sim_nccl``.

Rules:
1. It is a ``torch.distributed.ProcessGroup`` (a Python subclass, c10d's plugin path), so
   ``init_process_group(SIM_NCCL_BACKEND, ...)``, ``new_group``, ``destroy_process_group``
   and torch's collective functions take it. Each op goes to a ``SimProcessGroup`` on the
   process's simulated device, whose communicator's ``GlooWire`` meets the other
   processes' parts: NCCL's behaviour as ``SimulatedNccl`` models it, across processes.
2. It carries ``agang_device_runtime``, the process's simulated runtime, which agang's
   backend takes for its streams and events instead of ``torch.cuda``'s.
3. ``abort()`` and ``shutdown()`` (which ``destroy_process_group`` calls) end this rank's
   pending kernels as NCCL's do, then close the wire.
4. Torch calls that c10d makes only from C++ get only ``wait`` and ``get_future`` of its
   Work (c10d wraps a Python Work so); agang calls every method from Python.
5. Every op of c10d's base class that agang or torch's functions call is overridden here,
   under each of its names: one left to the base reaches a C++ group with no backend
   ("No backend type associated with device type cpu"). The others (the list forms of
   reduce-scatter and all-to-all, the coalesced forms, ``monitored_barrier``) are not
   simulated and fail so. ``batch_isend_irecv`` runs, but torch coalesces it only on its
   own ``ProcessGroup`` class, not on a plugin's: its transfers run one after another on
   the communicator's stream, so two ranks that each send, then receive, in one batch
   wait for each other (agang's ``exchange`` coalesces, and does not).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.sim_nccl.device import SimDevice
from agang._backends.sim_nccl.group import Communicator, SimProcessGroup, SimRuntime, SimWork
from agang._backends.sim_nccl.wire import GlooWire
from agang._runtime import fork

#: The name of the c10d backend of the simulation.
SIM_NCCL_BACKEND = "agang_sim_nccl"

_simulation: tuple[SimDevice, SimRuntime] | None = None


def _forget_in_child() -> None:
    # The parent's device (and its thread) is not the child's: it installs its own.
    global _simulation
    _simulation = None


fork.on_fork_in_child(_forget_in_child)


def register(device: SimDevice, runtime: SimRuntime) -> None:
    """Makes ``SIM_NCCL_BACKEND`` groups on ``device`` with ``runtime`` (once per process;
    a later call changes the device, for a forked child's new simulation)."""
    global _simulation
    _simulation = (device, runtime)
    if not hasattr(dist.Backend, SIM_NCCL_BACKEND.upper()):
        dist.Backend.register_backend(SIM_NCCL_BACKEND, _create, devices=["cpu"])


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SimNcclProcessGroup:
    if _simulation is None:
        raise RuntimeError(
            f"The '{SIM_NCCL_BACKEND}' backend needs this process's simulation: call "
            "agang.testing.use_simulated_nccl() first."
        )
    device, runtime = _simulation
    return SimNcclProcessGroup(store, rank, size, timeout, device=device, runtime=runtime)


class SimNcclProcessGroup(dist.ProcessGroup):
    """One rank of a simulated NCCL communicator across processes (module rules)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        *,
        device: SimDevice,
        runtime: SimRuntime,
        name: str = "",
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs omit this form
        self._name = name
        self._wire = GlooWire(store, rank, size, device, name, timeout) if size > 1 else None
        self._communicator = Communicator(name, size, wire=self._wire)
        self._sim = SimProcessGroup(self._communicator, rank, runtime, device)
        self._sim.set_timeout(timeout)
        self.agang_device_runtime = runtime  # rule 2

    # What c10d asks of a plugin's group.

    def getGroupName(self) -> str:  # c10d's name
        return self._name

    def setGroupName(self, name: str) -> None:  # c10d's name
        self._name = name
        self._communicator.name = name
        if self._wire is not None:
            self._wire.name = name

    def getBackendName(self) -> str:  # c10d's name
        return SIM_NCCL_BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        self._sim.set_timeout(timeout)

    def get_error(self) -> str:
        return self._sim.get_error()

    def abort(self) -> None:
        self._sim.abort()

    def shutdown(self) -> None:
        self._sim.shutdown()

    # Ops (c10d's names and arguments).

    def allreduce(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._sim.allreduce(tensors, _or(opts, dist.AllreduceOptions))

    def broadcast(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._sim.broadcast(tensors, _or(opts, dist.BroadcastOptions))

    def allgather(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._sim.allgather(outputs, inputs, opts)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> SimWork:
        return self._sim.all_gather_single(output, input, opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> SimWork:
        return self._sim.reduce_scatter_single(output, input, _or(opts, dist.ReduceScatterOptions))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> SimWork:
        return self._sim.all_to_all_single(output, input, output_split_sizes, input_split_sizes)

    # c10d's newer names of the single-tensor ops, which its C++ base also has.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]  # c10d names its arguments otherwise
    all_to_all_single = alltoall_base  # type: ignore[assignment]  # c10d overloads it

    def reduce(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._sim.reduce(tensors, opts)

    def gather(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SimWork:
        return self._sim.gather(outputs, inputs, opts)

    def scatter(  # type: ignore[override]  # c10d's overloads: the one c10d calls
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> SimWork:
        return self._sim.scatter(outputs, inputs, opts)

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> SimWork:
        return self._sim.send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> SimWork:
        return self._sim.recv(tensors, srcRank, tag)

    def barrier(self, opts: Any = None) -> SimWork:
        return self._sim.barrier(opts)

    def _start_coalescing(self, device: Any) -> None:
        self._sim._start_coalescing(device)

    def _end_coalescing(self, device: Any) -> SimWork:
        return self._sim._end_coalescing(device)


def _or(options: Any, kind: Any) -> Any:
    return kind() if options is None else options
