"""A gang of one process that plays every rank as a copy of itself (fairseq2's FakeGang).

Every simulated rank is assumed to hold the same tensors as this one, so SUM multiplies
by the size, PRODUCT raises to the size, MEAN, MIN and MAX leave values as they are, and
gathers repeat the input. It runs anywhere with no network, and is what :func:`agang.init`
returns for a world of size 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, final

import torch
from typing_extensions import override

from agang._base_gang import BaseGang
from agang._errors import GangError
from agang._gang import Gang
from agang._handle import Handle
from agang._issuing import Done
from agang._policy import GangPolicy, InFlightLimits, OnTimeout, make_policy
from agang._reduce_op import ReduceOp
from agang._validate import check_member_ranks, check_positive_int, check_rank


def _repeat_reduce(tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
    """Reduces, in place, ``size`` copies of ``tensor``."""
    if size == 1 or op in (ReduceOp.MEAN, ReduceOp.MIN, ReduceOp.MAX):
        return
    if tensor.dtype == torch.bool:
        return  # or / and of equal booleans
    if op is ReduceOp.SUM:
        tensor.mul_(size)
    elif op is ReduceOp.PRODUCT:
        tensor.pow_(size)


@final
class FakeGang(BaseGang):
    """One process simulating rank ``rank`` of a gang of ``size`` equal ranks.

    Args:
        rank: The simulated rank.
        size: The simulated number of ranks.
        device: Where tensors must live.
        op_timeout: The default deadline of ops (they finish at once, so rarely matters).
        on_timeout: ``"abort"`` (break the gang) or ``"raise"`` (fail only that op).
        limits: The in-flight bounds; None for the defaults.
        check_order: Accepted for symmetry; one simulated rank always agrees with itself.

    Example:
        >>> gang = agang.FakeGang(rank=0, size=4)
        >>> await gang.all_reduce(torch.ones(2))  # tensor([4., 4.])
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
        check_order: bool | None = False,
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
        super().__init__(
            rank=rank,
            size=size,
            device=torch.device(device),
            backend="fake",
            name="fake",
            policy=policy,
        )

    @override
    def _start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        _repeat_reduce(tensor, op, self.size)
        if post is not None:
            post()
        done(None)

    @override
    def _start_all_gather(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        output.view(self.size, -1).copy_(input.reshape(1, -1))
        done(None)

    @override
    def _start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        for output in outputs:
            output.copy_(input)
        done(None)

    @override
    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        output.view(-1).copy_(input.view(self.size, -1)[self.rank])
        _repeat_reduce(output, op, self.size)
        done(None)

    @override
    def _start_broadcast(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        done(None)

    @override
    def _start_all_to_all(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        # Rank j sends this rank its chunk number `rank`, which equals ours.
        chunk = input.view(self.size, -1)[self.rank]
        output.view(self.size, -1).copy_(chunk.unsqueeze(0))
        done(None)

    @override
    def broadcast_objects(
        self, objects: list[Any], source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[list[Any]]:
        # The source is a copy of this rank, so this rank's objects are the source's; as
        # a receiver it would get no bytes (broadcast is a no-op here) and fail to unpickle.
        check_rank(source_rank, self.size, name="source_rank")
        return super().broadcast_objects(objects, self.rank, timeout=timeout)

    def _no_peers(self) -> GangError:
        return GangError(
            "FakeGang simulates the other ranks as copies of this one, so it cannot send or "
            "receive; use agang.testing.FakeWorld for point-to-point tests."
        )

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        raise self._no_peers()

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        raise self._no_peers()

    @override
    def _start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        raise self._no_peers()  # unreachable: send() refuses first

    @override
    def _start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        raise self._no_peers()  # unreachable: recv() refuses first

    @override
    def _start_barrier(self, done: Done) -> None:
        done(None)

    @override
    def _release_backend(self, *, pending: bool) -> None:
        pass

    @override
    async def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        members = check_member_ranks(ranks, self.size)
        self._check_usable()
        if self.rank not in members:
            return None
        return FakeGang(
            rank=members.index(self.rank),
            size=len(members),
            device=self.device,
            policy=self._policy,
        )

    @override
    async def _create_lane(self, name: str, *, high_priority: bool) -> FakeGang:
        lane = FakeGang(rank=self.rank, size=self.size, device=self.device, policy=self._policy)
        lane._name = f"{self.name}/lane:{name}"
        return lane
