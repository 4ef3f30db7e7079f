"""The raw calls ``C10dBackend`` makes on a c10d group: options built, agang's reduce
ops mapped onto c10d's (``to_c10d``), complex viewed.

Each call uses the group's own method, not ``torch.distributed``'s function, so a group
double (``agang.testing.SimulatedNccl``'s) works too, and returns the group's Work
unwaited. c10d reduces complex tensors as pairs of reals, so every tensor goes in as
its real view (``real``); that is exact for SUM and for copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from agang._reduce_op import ReduceOp

_NATIVE = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def to_c10d(op: ReduceOp, *, backend: str) -> tuple[dist.ReduceOp.RedOpType, bool]:
    """Returns the c10d op to issue, and whether the result must then be divided by size.

    ``AVG`` exists on NCCL only; elsewhere MEAN is a SUM followed by a division.
    """
    if op is ReduceOp.MEAN:
        if backend == "nccl":
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    return _NATIVE[op], False


def all_reduce_options(op: ReduceOp, backend: str) -> tuple[dist.AllreduceOptions, bool]:
    """The options of an all-reduce by ``op``, and whether its result must be divided
    by the size after (MEAN where the backend has no AVG)."""
    c10d_op, divide = to_c10d(op, backend=backend)
    options = dist.AllreduceOptions()
    options.reduceOp = c10d_op  # type: ignore[assignment]  # stubs want the enum's class
    return options, divide


def divider(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    """A post-processing step that divides ``tensor`` by ``size`` in place."""

    def divide() -> None:
        with torch.no_grad():  # a leaf that requires grad takes results, as c10d writes them
            tensor.div_(size)

    return divide


def then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    """``first``, then ``second`` if there is one."""
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


def real(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or its view as pairs of reals if it is complex."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def all_gather_flat(group: Any, output: torch.Tensor, input: torch.Tensor) -> Any:
    options = AllgatherOptions()
    options.asyncOp = True
    method = getattr(group, "all_gather_single", None) or group._allgather_base
    return method(output, input, options)


def reduce_scatter_flat(
    group: Any, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType
) -> Any:
    options = dist.ReduceScatterOptions()
    options.reduceOp = op  # type: ignore[assignment]  # stubs want the enum's class
    options.asyncOp = True
    method = getattr(group, "reduce_scatter_single", None) or group._reduce_scatter_base
    return method(output, input, options)


def all_to_all_flat(
    group: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> Any:
    """Rows of ``input`` to each rank; empty split sizes (c10d's "none") mean equal blocks."""
    options = dist.AllToAllOptions()
    options.asyncOp = True
    method = getattr(group, "all_to_all_single", None) or group.alltoall_base
    return method(output, input, output_split_sizes or [], input_split_sizes or [], options)


def all_gather_uneven(
    group: Any, output: torch.Tensor, input: torch.Tensor, split_sizes: list[int]
) -> tuple[Any, torch.Tensor]:
    """An all-gather of blocks of ``split_sizes`` rows, as one all-to-all whose input is
    ``input`` repeated once per rank; returns the Work, and that repeated input, which
    must live until the op ends.

    Gloo's all-gather refuses blocks of different sizes ("invalid tensor size"), and
    its all-to-all takes split sizes. Each rank sends its rows once to every peer, as an
    all-gather does; the cost is the local copy of ``size`` times ``input``. NCCL takes
    the same path: one kernel, where c10d's list all-gather of uneven blocks would be
    one broadcast per rank.
    """
    size = len(split_sizes)
    repeated = input.repeat(size, *[1] * (input.dim() - 1))  # a contiguous copy
    rows = [input.shape[0]] * size
    return all_to_all_flat(group, output, repeated, split_sizes, rows), repeated


def exchange(
    group: Any,
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    device: torch.device | None,
) -> list[Any]:
    """Every send and receive, as c10d's ``batch_isend_irecv`` issues them: with a
    ``device`` (NCCL), inside one coalescing group, whose single Work is returned; without
    (Gloo, which cannot coalesce), one by one, each Work returned.

    If an op fails to issue inside the group, the group is still ended, so the
    communicator is not left coalescing every later op into it; the error is raised.
    """
    if device is None:
        works = [group.send([real(t)], peer, 0) for t, peer in sends]
        return works + [group.recv([real(t)], peer, 0) for t, peer in recvs]
    group._start_coalescing(device)
    try:
        for tensor, peer in sends:
            group.send([real(tensor)], peer, 0)
        for tensor, peer in recvs:
            group.recv([real(tensor)], peer, 0)
    except BaseException:
        with contextlib.suppress(Exception):
            group._end_coalescing(device)
        raise
    return [group._end_coalescing(device)]


# The rooted collectives. c10d takes the root's blocks as a list (one tensor per rank)
# and an empty list of lists on the other ranks.


def reduce(
    group: Any, tensor: torch.Tensor, destination_rank: int, op: dist.ReduceOp.RedOpType
) -> Any:
    options = dist.ReduceOptions()
    options.reduceOp = op  # type: ignore[assignment]  # stubs want the enum's class
    options.rootRank = destination_rank
    options.rootTensor = 0
    return group.reduce([real(tensor)], options)


def gather(
    group: Any, outputs: list[torch.Tensor] | None, input: torch.Tensor, destination_rank: int
) -> Any:
    options = dist.GatherOptions()
    options.rootRank = destination_rank
    lists = [] if outputs is None else [[real(t) for t in outputs]]
    return group.gather(lists, [real(input)], options)


def scatter(
    group: Any, output: torch.Tensor, inputs: list[torch.Tensor] | None, source_rank: int
) -> Any:
    options = dist.ScatterOptions()
    options.rootRank = source_rank
    lists = [] if inputs is None else [[real(t) for t in inputs]]
    return group.scatter([real(output)], lists, options)


def connect_eagerly(group: dist.ProcessGroup, device: torch.device) -> None:
    """Makes ``group``'s NCCL communicator on ``device`` now, on the calling thread.

    c10d makes an NCCL communicator lazily, at the group's first op, unless the group was
    made bound to a device (``init_process_group(device_id=...)``). That first op runs on
    the caller's event loop, under the gang's lock: a member that never comes would then
    hold the loop until NCCL gives up. Set-up calls this on its own thread instead,
    within its deadline; every member must call it (NCCL's communicator is made by all
    of them together). A group already bound to a device is connected already.
    """
    if getattr(group, "bound_device_id", None) is not None:
        return
    group._get_backend(device).eager_connect_single_device(device)
