"""The backend of a gang of one process that plays every rank as a copy of itself.

Every simulated rank is assumed to hold the same tensors as this one, so SUM multiplies
by the size, PRODUCT raises to the size, MEAN, MIN and MAX leave values as they are, and
gathers repeat the input. A rooted op computes on its root only: a reduce elsewhere and a
scatter off its source leave their tensor as it is. Every op finishes inside its
``start_*`` call. It implements the contract of ``contract``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import final

import torch

from agang._backends.contract import Blamed, Checked, Done, Explanation, ProgressOf
from agang._backends.cuda.runtime import StreamOrder
from agang._errors import GangError
from agang._reduce_op import ReduceOp

_SUM, _PRODUCT = ReduceOp.SUM, ReduceOp.PRODUCT  # an enum member's lookup costs per op
_BOOL = torch.bool


def _repeat_reduce(tensor: torch.Tensor, op: ReduceOp, size: int) -> None:
    """Reduces, in place, ``size`` copies of ``tensor``: SUM multiplies, PRODUCT raises
    to the power, MEAN, MIN and MAX leave it, and so does either on booleans (or / and
    of equal values)."""
    if size == 1 or (op is not _SUM and op is not _PRODUCT) or tensor.dtype == _BOOL:
        return
    if op is _SUM:
        tensor.mul_(size)
    else:
        tensor.pow_(size)


def no_peers() -> GangError:
    return GangError(
        "FakeGang simulates the other ranks as copies of this one, so it cannot send or "
        "receive; use agang.testing.FakeWorld for point-to-point tests."
    )


def _not_copies(name: str, sizes: list[int], rows: int) -> GangError:
    return GangError(
        f"FakeGang simulates the other ranks as copies of this one, so every rank sends "
        f"{rows} rows here, but `{name}` is {sizes}; use agang.testing.FakeWorld for "
        f"ranks whose blocks differ."
    )


def _apart(input: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``input``, or a copy of it where it shares memory with ``output``: a gather in
    place passes this rank's block of ``output`` as ``input``, and torch refuses to copy
    a tensor into memory that holds it. (Both are contiguous: one range each.)"""
    start, end = input.data_ptr(), input.data_ptr() + input.nbytes
    if start < output.data_ptr() + output.nbytes and output.data_ptr() < end:
        return input.clone()
    return input


@final
class FakeBackend:
    """Rank ``rank`` of ``size`` equal simulated ranks, in this process."""

    def __init__(self, *, rank: int, size: int, device: torch.device, name: str) -> None:
        self._rank = rank
        self._size = size
        self._device = device
        self._name = name

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kind(self) -> str:
        return "fake"

    @property
    def name(self) -> str:
        return self._name

    def start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        if tensor.requires_grad:  # the result goes in as c10d writes it: outside autograd
            with torch.no_grad():
                _repeat_reduce(tensor, op, self._size)
        else:  # the common case, without a grad-mode switch per op
            _repeat_reduce(tensor, op, self._size)
        if post is not None:
            post()
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, done: Done, *, to_host: bool = False
    ) -> None:
        output.view(self._size, -1).copy_(_apart(input, output).reshape(1, -1))
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        for output in outputs:
            output.copy_(input)
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        output.view(-1).copy_(input.view(self._size, -1)[self._rank])
        _repeat_reduce(output, op, self._size)
        done(None)

    def start_broadcast(
        self, tensor: torch.Tensor, source_rank: int, done: Done, *, to_host: bool = False
    ) -> None:
        done(None)  # the source holds what this rank holds

    @torch.no_grad()  # results go into tensors that may require grad
    def start_all_gather_uneven(
        self, output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], done: Done
    ) -> None:
        if any(n != input.shape[0] for n in split_sizes):
            raise _not_copies("output_split_sizes", split_sizes, input.shape[0])
        output.view(self._size, *input.shape).copy_(_apart(input, output).unsqueeze(0))
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        done: Done,
        *,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        # Rank j sends this rank its block number `rank`, which equals ours.
        if output_split_sizes is None or input_split_sizes is None:
            chunk = input.view(self._size, -1)[self._rank]
            output.view(self._size, -1).copy_(chunk.unsqueeze(0))
            done(None)
            return
        rows = input_split_sizes[self._rank]
        if any(n != rows for n in output_split_sizes):
            raise _not_copies("output_split_sizes", output_split_sizes, rows)
        block = input.split_with_sizes(input_split_sizes)[self._rank]
        output.view(self._size, *block.shape).copy_(block.unsqueeze(0))
        done(None)

    # The rooted collectives: the root is a copy of this rank too.

    @torch.no_grad()  # results go into tensors that may require grad
    def start_reduce(
        self, tensor: torch.Tensor, destination_rank: int, op: ReduceOp, done: Done
    ) -> None:
        if self._rank == destination_rank:  # elsewhere ``tensor`` is left as it is
            _repeat_reduce(tensor, op, self._size)
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_gather(
        self,
        outputs: list[torch.Tensor] | None,
        input: torch.Tensor,
        destination_rank: int,
        done: Done,
    ) -> None:
        for output in outputs or ():  # outputs: on the destination only
            output.copy_(input)
        done(None)

    @torch.no_grad()  # results go into tensors that may require grad
    def start_scatter(
        self,
        output: torch.Tensor,
        inputs: list[torch.Tensor] | None,
        source_rank: int,
        done: Done,
    ) -> None:
        # Off the source this rank has no copy of the source's blocks: ``output`` is
        # left as it is, as broadcast leaves its tensor.
        if inputs is not None:
            output.copy_(inputs[self._rank])
        done(None)

    def start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        raise no_peers()  # FakeGang refuses the call before issuing it

    def start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        raise no_peers()  # FakeGang refuses the call before issuing it

    def start_exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        done: Done,
    ) -> None:
        raise no_peers()  # FakeGang refuses the call before issuing it

    def start_barrier(self, done: Done) -> None:
        done(None)

    def start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        checked(None, None)  # one simulated rank always agrees with itself

    def serve_progress(self, progress: ProgressOf) -> None:
        pass  # no peer ever asks

    def start_blame(self, number: int, report: Blamed, *, collective: bool = False) -> None:
        # Its other ranks are simulated by the same process: there is nobody to ask.
        report(None, "a fake gang's other ranks are simulated, not asked")

    def where(self, rank: int) -> str:
        return f"rank {rank}"

    def explain(self, error: BaseException) -> Explanation:
        return Explanation()

    polls = False  # every op reports its own end

    def poll(self) -> None:
        pass

    def park(self, issued_before: float = math.inf) -> float | None:
        return None

    def defer(self, start: Callable[[], None]) -> Callable[[], None]:
        return start

    def stream_order(self) -> StreamOrder | None:
        return None

    def allow_timeout(self, seconds: float | None) -> None:
        pass

    def abort(self, reason: str | None = None) -> None:
        pass

    def release(self, *, unfinished: bool) -> None:
        pass

    async def create_child(
        self, members: list[int], *, name: str, high_priority: bool, seconds: float | None
    ) -> FakeBackend | None:
        if self._rank not in members:
            return None
        return FakeBackend(
            rank=members.index(self._rank), size=len(members), device=self._device, name=name
        )
