"""The rooted collectives, checked and described: reduce, gather and scatter.

One rank, the root, plays another role than the others: it alone receives the reduction
(``reduce``), receives every rank's block (``gather``) or sends one block to every rank
(``scatter``). The tensor only the root uses must be None elsewhere, so a call that
mixes up the roles fails at once, naming it, instead of being ignored.

Each function checks its call against the gang's ``agang._collective.checks.Group``
and returns the ``Op`` (``agang._engine.ops``) the gang issues, with a fingerprint naming
the root, so ranks that disagree on it fail the order check. The root's blocks go to the
backend as views of its stacked or concatenated tensor, one per rank, as c10d takes them.
Their documentation is the ``Gang``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agang._backends.contract import Backend
from agang._backends.fingerprint import describe
from agang._collective.checks import (
    Group,
    check_reduce_dtype,
    check_root_only,
    check_same_dtype,
    check_stacked_or_concatenated,
)
from agang._engine.ops import Op
from agang._reduce_op import ReduceOp
from agang._validate import check_rank, check_reduce_op


def blocks(tensor: torch.Tensor, size: int, part: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``tensor``'s ``size`` blocks shaped ``part``, in rank order; ``tensor``
    is stacked or concatenated (both are the same bytes in the same order)."""
    return list(tensor.view(size, *part).unbind(0))


def _root_tensor(
    group: Group, tensor: torch.Tensor | None, block: torch.Tensor, *, is_root: bool, name: str
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The root-only ``tensor`` (gather's output, scatter's input), checked, and views
    of its per-rank blocks shaped like ``block``; (None, None) off the root."""
    root = "destination rank" if name == "output" else "source rank"
    check_root_only(tensor, is_root=is_root, name=name, root=root)
    if tensor is None:
        return None, None
    tensor = group.tensor(tensor, name)
    output, input = (tensor, block) if name == "output" else (block, tensor)
    check_same_dtype(output, input)
    check_stacked_or_concatenated(tensor, group.size, block.shape, name=name)
    return tensor, blocks(tensor, group.size, block.shape)


def reduce(
    group: Group, backend: Backend, tensor: torch.Tensor, destination_rank: int, op: ReduceOp
) -> Op:
    tensor = group.tensor(tensor, "tensor")
    destination_rank = check_rank(destination_rank, group.size, name="destination_rank")
    op = check_reduce_op(op)
    check_reduce_dtype(tensor, op, name="tensor")
    return (
        "reduce",
        [("tensor", tensor)],
        tensor,
        lambda done: backend.start_reduce(tensor, destination_rank, op, done),
        lambda: f"reduce({op.name}, destination_rank={destination_rank}, {describe(tensor)})",
    )


def gather(
    group: Group,
    backend: Backend,
    output: torch.Tensor | None,
    input: torch.Tensor,
    destination_rank: int,
) -> Op:
    input = group.tensor(input, "input")
    destination_rank = check_rank(destination_rank, group.size, name="destination_rank")
    output, outputs = _root_tensor(
        group, output, input, is_root=group.rank == destination_rank, name="output"
    )
    tensors = [("input", input)] if output is None else [("output", output), ("input", input)]
    return (
        "gather",
        tensors,
        output,
        lambda done: backend.start_gather(outputs, input, destination_rank, done),
        lambda: f"gather(destination_rank={destination_rank}, {describe(input)})",
    )


def scatter(
    group: Group,
    backend: Backend,
    output: torch.Tensor,
    input: torch.Tensor | None,
    source_rank: int,
) -> Op:
    output = group.tensor(output, "output")
    source_rank = check_rank(source_rank, group.size, name="source_rank")
    input, inputs = _root_tensor(
        group, input, output, is_root=group.rank == source_rank, name="input"
    )
    tensors = [("output", output)] if input is None else [("output", output), ("input", input)]
    return (
        "scatter",
        tensors,
        output,
        lambda done: backend.start_scatter(output, inputs, source_rank, done),
        lambda: f"scatter(source_rank={source_rank}, {describe(output)})",
    )
