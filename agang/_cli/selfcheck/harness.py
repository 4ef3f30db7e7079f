"""Where the self-check runs: real NCCL on this machine's GPUs, or the simulation.

A harness gives the checks the gangs of the ranks in this process (every rank of the
simulation; this rank's one on GPUs) and the few device acts a check needs: make the
last rank's device late, mark a stream's end, compute a reference. The checks
(``agang._cli.selfcheck.checks``) are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import torch

from agang._gang import Gang
from agang.testing import SimulatedNccl

StallEnd = Callable[[], "float | None"]
"""Blocks until this process's stalled rank's device got past the stall, and returns
that moment (``time.monotonic()``); None at once where this process stalls no rank."""


class Harness(Protocol):
    """The devices and gangs a self-check runs on."""

    description: str
    size: int
    prints: bool  # whether this process prints the table (rank 0's)

    async def gangs(self, name: str, *, stream_ordered: bool = False) -> list[Gang]:
        """The local ranks' gangs over a new communicator (a collective call)."""

    def stall(self, seconds: float) -> StallEnd:
        """Makes the last rank's device busy for ``seconds`` on its current stream (a
        peer that is late); does nothing on the other ranks. Returns how to learn when
        this process's stalled device got past the stall."""

    def mark(self, gang: Gang) -> Any:
        """An event at the end of ``gang``'s rank's current stream: ``query()`` says
        whether the device got there."""

    async def settle(self) -> None:
        """Waits until every local device ran everything queued on its current stream."""

    def reference_gradients(
        self, models: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each local rank's flat gradients of ``model(input).square().mean()``,
        averaged over every rank by a reference (DDP on GPUs; a collective call)."""

    def device_binding(self) -> tuple[bool, str]:
        """Whether this process's threads bound the right device before using it."""

    def stream_privacy(self, gang: Gang) -> tuple[bool, str] | None:
        """Whether ``gang``'s side stream is its own; None where that cannot be seen."""

    async def gather(self, rows: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
        """Every rank's rows, in rank order (a collective call)."""

    async def close(self) -> None:
        """Closes what the harness made."""


class SimulatedHarness:
    """Every rank of an ``agang.testing.SimulatedNccl`` in this process, on the CPU."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.prints = True  # every rank is in this process
        self.description = f"simulated NCCL, {size} ranks on this CPU"
        self._sim = SimulatedNccl(size, watchdog_timeout=60.0)
        self._made: list[Gang] = []

    async def gangs(self, name: str, *, stream_ordered: bool = False) -> list[Gang]:
        gangs: list[Gang] = list(self._sim.gangs(name, stream_ordered=stream_ordered))
        self._made += gangs
        return gangs

    def stall(self, seconds: float) -> StallEnd:
        stall = self._sim.stall(self.size - 1, seconds)  # counts from when the device starts it
        return lambda: stall.wait(seconds + 5.0)

    def mark(self, gang: Gang) -> Any:
        return self._sim.record_event(gang.rank)

    async def settle(self) -> None:
        for rank in range(self.size):
            await anyio.to_thread.run_sync(self._sim.synchronize, rank)

    def reference_gradients(
        self, models: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        flats = []
        for model, x in zip(models, inputs, strict=True):
            model(x).square().mean().backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # type: ignore[union-attr]
        mean = torch.stack(flats).mean(0)
        return [mean.clone() for _ in flats]

    def device_binding(self) -> tuple[bool, str]:
        wanted = {"agang-nccl-watch", "agang: abort gang", "agang: close gang"}
        names = self._sim.bound_threads(0)
        seen = {kind for kind in wanted if any(n.startswith(kind) for n in names)}
        ok = seen == wanted
        detail = f"{len(names)} thread bindings on rank 0 ({', '.join(sorted(seen))})"
        return ok, detail if ok else f"missing: {', '.join(sorted(wanted - seen))}"

    def stream_privacy(self, gang: Gang) -> tuple[bool, str] | None:
        return None  # simulated streams are never pooled

    async def gather(self, rows: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
        return [rows]  # one process: its checks covered every rank

    async def close(self) -> None:
        for gang in self._made:
            await gang.close()
        self._sim.close()
