"""``FakeWorld``: n ranks in one event loop, with the real semantics of collectives.

The simulation itself is a backend (``agang.testing._world.backend``); a
``FakeWorldGang`` is the one gang implementation over it, so a test on a FakeWorld runs
the same engine, numbering and statistics as production does on c10d.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, final

import anyio
import torch

from agang._collective.gang import CollectiveGang
from agang._gang import Gang
from agang._policy import CheckOrder, GangPolicy, InFlightLimits, OnTimeout, make_policy
from agang._validate import check_positive_int, check_timeout
from agang.testing._world.backend import Communicator, FakeWorldBackend, Simulation

T = TypeVar("T")


@final
class FakeWorldGang(CollectiveGang):
    """One rank of a [`FakeWorld`][agang.testing.FakeWorld].

    Args:
        communicator: The simulated communicator the rank belongs to.
        rank: This gang's rank in it.
        name: The gang's name.
        policy: Timeouts, in-flight bounds and order checking.
        device: Where tensors must live.
    """

    def __init__(
        self,
        communicator: Communicator,
        *,
        rank: int,
        name: str,
        policy: GangPolicy,
        device: torch.device,
    ) -> None:
        super().__init__(
            FakeWorldBackend(communicator, rank=rank, name=name, device=device), policy
        )


@final
class FakeWorld:
    """``size`` ranks in one process and one event loop, for users' tests.

    Collectives meet across the ranks and compute real results (unlike
    [`agang.FakeGang`][agang.FakeGang], which assumes every rank holds the same data). Ops complete
    on the loop, after ``latency`` seconds if given; deadlines, cancellation and busy
    tensors behave as on a real backend.

    Args:
        size: The number of ranks.
        device: Where tensors must live.
        op_timeout: The gangs' default deadline in seconds (None: agang's default, 300 s;
            ``math.inf``: none).
        latency: Seconds each op takes to complete once every rank has issued it.
        on_timeout: ``"abort"`` (a timeout breaks the gang) or ``"raise"`` (only that op
            fails).
        limits: The in-flight bounds ([`agang.InFlightLimits`][agang.InFlightLimits]); None for
            defaults.
        check_order: Compare each collective's fingerprint across ranks before starting
            it; None reads ``AGANG_CHECK_ORDER``.

    Example:
        ```python
        import asyncio

        import torch

        from agang.testing import FakeWorld


        async def step(gang):
            return (await gang.all_reduce(torch.ones(1))).item()


        world = FakeWorld(4)
        assert asyncio.run(world.run(step)) == [4.0, 4.0, 4.0, 4.0]
        ```
    """

    def __init__(
        self,
        size: int,
        *,
        device: torch.device | str = "cpu",
        op_timeout: float | None = 60.0,
        latency: float = 0.0,
        on_timeout: OnTimeout = "abort",
        limits: InFlightLimits | None = None,
        check_order: CheckOrder | None = False,
    ) -> None:
        check_positive_int(size, name="size")
        simulation = Simulation(check_timeout(latency, name="latency") or 0.0)
        communicator = Communicator(simulation, size)
        policy = make_policy(
            op_timeout=op_timeout, on_timeout=on_timeout, limits=limits, check_order=check_order
        )
        self.gangs: list[FakeWorldGang] = [
            FakeWorldGang(
                communicator,
                rank=rank,
                name="fake-world",
                policy=policy,
                device=torch.device(device),
            )
            for rank in range(size)
        ]

    @property
    def size(self) -> int:
        """The number of ranks (in-process gangs) in the world."""
        return len(self.gangs)

    def __getitem__(self, rank: int) -> FakeWorldGang:
        return self.gangs[rank]

    def __len__(self) -> int:
        return len(self.gangs)

    async def run(self, fn: Callable[[Gang], Awaitable[T]]) -> list[T]:
        """Runs ``fn(gang)`` for every rank concurrently; returns the results by rank."""
        results: list[Any] = [None] * self.size

        async def one(rank: int) -> None:
            results[rank] = await fn(self.gangs[rank])

        async with anyio.create_task_group() as group:
            for rank in range(self.size):
                group.start_soon(one, rank)
        return results
