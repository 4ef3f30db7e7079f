"""The raw calls ``C10dBackend`` makes on a c10d group: options built, complex viewed.

Each call uses the group's own method, not ``torch.distributed``'s function, so a group
double (``agang.testing.SimulatedNccl``'s) works too, and returns the group's Work
unwaited. c10d reduces complex tensors as pairs of reals, so every tensor goes in as
its real view (``real``); that is exact for SUM and for copies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions


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


def all_to_all_flat(group: Any, output: torch.Tensor, input: torch.Tensor) -> Any:
    options = dist.AllToAllOptions()
    options.asyncOp = True
    method = getattr(group, "all_to_all_single", None) or group.alltoall_base
    return method(output, input, [], [], options)


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
