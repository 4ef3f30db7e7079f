"""The even collectives, checked and described: every rank's block has one shape.

``all_gather_to_list``, ``reduce_scatter``, ``broadcast`` and ``barrier``, and the checks
of ``all_reduce_bucketed``'s tensors. ``all_reduce`` itself is the gang's own
(``CollectiveGang.all_reduce``): the most frequent call keeps an inline path, and it
decides whether an open ``coalesce()`` scope holds it.

Each function checks its call against the gang's ``agang._collective.checks.Group``
and returns the ``Op`` (``agang._engine.ops``) the gang issues; its fingerprint names
what every rank must agree on (op, shapes, dtypes, reduce op, root). Their documentation
is the ``Gang``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agang._backends.contract import Backend
from agang._backends.fingerprint import describe
from agang._collective.checks import (
    Group,
    check_distinct,
    check_reduce_dtype,
    check_same_dtype,
    check_shape,
    check_stacked_or_concatenated,
    check_tensor_list,
)
from agang._engine.ops import Op
from agang._reduce_op import ReduceOp
from agang._validate import check_rank, check_reduce_op


def bucketed(
    group: Group, tensors: Sequence[torch.Tensor], op: ReduceOp
) -> tuple[list[torch.Tensor], ReduceOp]:
    """``all_reduce_bucketed``'s tensors and reduce op, checked: each one for the gang and
    the op, and no two sharing memory (each is overwritten with its own result)."""
    items = check_tensor_list(tensors, name="tensors", length=None)
    checked = [group.tensor(t, f"tensors[{i}]") for i, t in enumerate(items)]
    op = check_reduce_op(op)
    for i, tensor in enumerate(checked):
        check_reduce_dtype(tensor, op, name=f"tensors[{i}]")
    check_distinct(checked, name="tensors")
    return checked, op


def all_gather_to_list(
    group: Group, backend: Backend, outputs: Sequence[torch.Tensor], input: torch.Tensor
) -> Op:
    input = group.tensor(input, "input")
    items = check_tensor_list(outputs, name="outputs", length=group.size)
    checked = [group.tensor(t, f"outputs[{i}]") for i, t in enumerate(items)]
    for i, output in enumerate(checked):
        check_same_dtype(output, input)
        check_shape(output, input.shape, name=f"outputs[{i}]")
    tensors = [(f"outputs[{i}]", t) for i, t in enumerate(checked)] + [("input", input)]
    return (
        "all_gather_to_list",
        tensors,
        checked,
        lambda done: backend.start_all_gather_to_list(checked, input, done),
        lambda: f"all_gather_to_list({describe(input)})",
    )


def reduce_scatter(
    group: Group, backend: Backend, output: torch.Tensor, input: torch.Tensor, op: ReduceOp
) -> Op:
    input = group.tensor(input, "input")
    output = group.tensor(output, "output")
    op = check_reduce_op(op)
    check_same_dtype(output, input)
    check_reduce_dtype(input, op, name="input")
    check_stacked_or_concatenated(input, group.size, output.shape, name="input")
    flat = input.view(-1)
    return (
        "reduce_scatter",
        [("output", output), ("input", input)],
        output,
        lambda done: backend.start_reduce_scatter(output, flat, op, done),
        lambda: f"reduce_scatter({op.name}, {describe(input)})",
    )


def broadcast(group: Group, backend: Backend, tensor: torch.Tensor, source_rank: int) -> Op:
    tensor = group.tensor(tensor, "tensor")
    source_rank = check_rank(source_rank, group.size, name="source_rank")
    return (
        "broadcast",
        [("tensor", tensor)],
        tensor,
        lambda done: backend.start_broadcast(tensor, source_rank, done),
        lambda: f"broadcast(source_rank={source_rank}, {describe(tensor)})",
    )


def barrier(backend: Backend) -> Op:
    return ("barrier", [], None, backend.start_barrier, "barrier()")
