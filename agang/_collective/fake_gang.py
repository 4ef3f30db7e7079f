"""A gang of one process that plays every rank as a copy of itself (fairseq2's FakeGang).

It runs anywhere with no network, and is what [`agang.init`][agang.init] returns for a world of
size 1. The simulation is its backend's (``agang._backends.fake``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import torch
from typing_extensions import override

from agang._backends.fake import FakeBackend, no_peers
from agang._collective.gang import CollectiveGang
from agang._gang import Serializer, Transfer
from agang._handle import Handle
from agang._policy import CheckOrder, GangPolicy, InFlightLimits, OnTimeout, make_policy
from agang._validate import check_positive_int, check_rank


@final
class FakeGang(CollectiveGang):
    """One process simulating rank ``rank`` of a gang of ``size`` equal ranks.

    Args:
        rank: The simulated rank.
        size: The simulated number of ranks.
        device: Where tensors must live.
        op_timeout: The default deadline of ops (they finish at once, so rarely matters;
            None: agang's default, 300 s; ``math.inf``: none).
        on_timeout: ``"abort"`` (break the gang) or ``"raise"`` (fail only that op).
        limits: The in-flight bounds; None for the defaults.
        check_order: Accepted for symmetry; one simulated rank always agrees with itself.
        policy: All of the above as one value (sub-gangs pass their parent's); when
            given, ``op_timeout``, ``on_timeout``, ``limits`` and ``check_order`` are
            not read.

    Example:
        ```python
        import asyncio

        import torch

        import agang

        gang = agang.FakeGang(rank=0, size=4)  # assumes every rank holds the same data


        async def main():
            return await gang.all_reduce(torch.ones(2))


        assert asyncio.run(main()).tolist() == [4.0, 4.0]
        ```
    """

    def __init__(
        self,
        *,
        rank: int = 0,
        size: int = 1,
        device: torch.device | str = "cpu",
        op_timeout: float | None = None,
        on_timeout: OnTimeout = "abort",
        limits: InFlightLimits | None = None,
        check_order: CheckOrder | None = False,
        policy: GangPolicy | None = None,
    ) -> None:
        check_positive_int(size, name="size")
        if policy is None:
            policy = make_policy(
                op_timeout=op_timeout,
                on_timeout=on_timeout,
                limits=limits,
                check_order=check_order,
            )
        check_rank(rank, size, name="rank")
        backend = FakeBackend(rank=rank, size=size, device=torch.device(device), name="fake")
        super().__init__(backend, policy)

    @override
    def broadcast_objects(
        self,
        objects: list[Any],
        source_rank: int = 0,
        *,
        timeout: float | None = None,
        serializer: Serializer = "safe",
    ) -> Handle[list[Any]]:
        """[`agang.Gang.broadcast_objects`][agang.Gang.broadcast_objects]: every rank of a fake gang
        is a copy of the source, so each gets its own ``objects`` back (round-tripped)."""
        # The source is a copy of this rank, so this rank's objects are the source's; as
        # a receiver it would get no bytes (broadcast is a no-op here) and fail to unpickle.
        check_rank(source_rank, self.size, name="source_rank")
        return super().broadcast_objects(objects, self.rank, timeout=timeout, serializer=serializer)

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        """Refused: a fake gang has no peer to send to (``RuntimeError``)."""
        raise no_peers()

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        """Refused: a fake gang has no peer to receive from (``RuntimeError``)."""
        raise no_peers()

    @override
    def exchange(
        self,
        sends: Sequence[Transfer] = (),
        recvs: Sequence[Transfer] = (),
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        """Refused: a fake gang has no peer to exchange with (``RuntimeError``)."""
        raise no_peers()
