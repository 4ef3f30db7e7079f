"""The collectives whose blocks may differ by rank, checked and described: all_gather and
all_to_all (with split sizes or without), and the point-to-point ones (send, recv, and
exchange, batched sends and receives).

Split sizes bring checks of their own: a rank checks what it can alone (its sizes'
type, length and values, its tensors' rows, its block to itself). The rest, every pair
of ranks agreeing on the rows between them, is the caller's to keep (see
``Gang.all_to_all``), or the order check's where it is on: the fingerprint of an uneven
all_to_all names the dtype and the shape past the first dimension on its first line,
and this rank's sizes on a second, which the check compares pair by pair
(``agang._backends.fingerprint``), so sizes that disagree fail the op on every rank
before any row moves. An uneven all_gather's sizes are equal on every rank, so its
fingerprint names them. The point-to-point ops are not order-checked: their peers, not
the whole gang, must agree on them.

Each function checks its call against the gang's ``agang._collective.checks.Group``
and returns the ``Op`` (``agang._engine.ops``) the gang issues. Their documentation is
the ``Gang``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agang._backends import fingerprint
from agang._backends.contract import Backend
from agang._backends.fingerprint import describe, describe_rows
from agang._collective.checks import (
    Group,
    check_apart,
    check_rows,
    check_same_dtype,
    check_shape,
    check_split_sizes,
    check_stacked_or_concatenated,
    check_trailing_shape,
)
from agang._engine.ops import Op
from agang._gang import Transfer
from agang._validate import check_rank


def _splits(
    given: object, tensor: torch.Tensor, size: int, *, name: str, tensor_name: str
) -> list[int]:
    """``given`` split sizes of ``tensor``, checked; None means equal blocks, as in c10d."""
    if given is None:
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise ValueError(
                f"`{tensor_name}` must have a first dimension that is a multiple of the gang's "
                f"size ({size}) when `{name}` is None, but has shape {tuple(tensor.shape)} "
                f"instead."
            )
        return [tensor.shape[0] // size] * size
    sizes = check_split_sizes(given, size, name=name)
    check_rows(tensor, sizes, name=tensor_name, sizes_name=name)
    return sizes


def _transfers(group: Group, items: object, *, name: str) -> list[tuple[torch.Tensor, int]]:
    """``items``, a sequence of ``(tensor, rank)`` pairs, checked: each tensor for the
    gang, each rank another rank of the gang."""
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        raise TypeError(
            f"`{name}` must be a sequence of (tensor, rank) pairs, but is of type "
            f"`{type(items).__name__}` instead."
        )
    checked = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise TypeError(
                f"`{name}[{i}]` must be a (tensor, rank) pair, but is {item!r} instead."
            )
        tensor = group.tensor(item[0], f"{name}[{i}][0]")
        rank = check_rank(item[1], group.size, name=f"{name}[{i}][1]", self_rank=group.rank)
        checked.append((tensor, rank))
    return checked


def all_gather(
    group: Group,
    backend: Backend,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
) -> Op:
    input = group.tensor(input, "input")
    output = group.tensor(output, "output")
    check_same_dtype(output, input)
    tensors = [("output", output), ("input", input)]
    if output_split_sizes is None:
        check_stacked_or_concatenated(output, group.size, input.shape, name="output")
        flat = output.view(-1)
        return (
            "all_gather",
            tensors,
            output,
            lambda done: backend.start_all_gather(flat, input, done),
            lambda: f"all_gather({describe(input)})",
        )
    sizes = check_split_sizes(output_split_sizes, group.size, name="output_split_sizes")
    rank = group.rank
    if input.dim() == 0 or input.shape[0] != sizes[rank]:
        raise ValueError(
            f"`input` must have output_split_sizes[{rank}] = {sizes[rank]} rows "
            f"(this rank's size), but has shape {tuple(input.shape)} instead."
        )
    check_trailing_shape(output, input)
    check_rows(output, sizes, name="output", sizes_name="output_split_sizes")
    return (
        "all_gather",
        tensors,
        output,
        lambda done: backend.start_all_gather_uneven(output, input, sizes, done),
        lambda: f"all_gather(output_split_sizes={sizes}, {describe_rows(input)})",
    )


def all_to_all(
    group: Group,
    backend: Backend,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> Op:
    input = group.tensor(input, "input")
    output = group.tensor(output, "output")
    check_same_dtype(output, input)
    # Every rank writes its blocks into `output` while its peers still read `input`: in
    # place, or shifted by rows, some ranks would get rows already overwritten.
    check_apart([("output", output, True), ("input", input, False)])
    tensors = [("output", output), ("input", input)]
    size = group.size
    if output_split_sizes is None and input_split_sizes is None:
        check_shape(output, input.shape, name="output")
        if input.dim() == 0 or input.shape[0] % size:
            raise ValueError(
                f"`input` must have a first dimension that is a multiple of the gang's "
                f"size ({size}), but has shape {tuple(input.shape)} instead."
            )
        return (
            "all_to_all",
            tensors,
            output,
            lambda done: backend.start_all_to_all(output, input, done),
            lambda: f"all_to_all({describe(input)})",
        )
    input_splits = _splits(
        input_split_sizes, input, size, name="input_split_sizes", tensor_name="input"
    )
    output_splits = _splits(
        output_split_sizes, output, size, name="output_split_sizes", tensor_name="output"
    )
    check_trailing_shape(output, input)
    rank = group.rank
    if input_splits[rank] != output_splits[rank]:
        raise ValueError(
            f"`output_split_sizes` must give this rank's block to itself as many rows as "
            f"`input_split_sizes` ({input_splits[rank]} at index {rank}), but gives "
            f"{output_splits[rank]} instead."
        )
    return (
        "all_to_all",
        tensors,
        output,
        lambda done: backend.start_all_to_all(
            output,
            input,
            done,
            output_split_sizes=output_splits,
            input_split_sizes=input_splits,
        ),
        lambda: fingerprint.with_flows(
            f"all_to_all(split, {describe_rows(input)})", input_splits, output_splits
        ),
    )


def send(group: Group, backend: Backend, tensor: torch.Tensor, destination_rank: int) -> Op:
    tensor = group.tensor(tensor, "tensor")
    destination_rank = check_rank(
        destination_rank, group.size, name="destination_rank", self_rank=group.rank
    )
    return (
        "send",
        [("tensor", tensor)],
        None,
        lambda done: backend.start_send(tensor, destination_rank, done),
        None,
    )


def recv(group: Group, backend: Backend, tensor: torch.Tensor, source_rank: int) -> Op:
    tensor = group.tensor(tensor, "tensor")
    source_rank = check_rank(source_rank, group.size, name="source_rank", self_rank=group.rank)
    return (
        "recv",
        [("tensor", tensor)],
        tensor,
        lambda done: backend.start_recv(tensor, source_rank, done),
        None,
    )


def exchange(
    group: Group, backend: Backend, sends: Sequence[Transfer], recvs: Sequence[Transfer]
) -> Op:
    checked_sends = _transfers(group, sends, name="sends")
    checked_recvs = _transfers(group, recvs, name="recvs")
    if not checked_sends and not checked_recvs:
        raise ValueError(
            "`sends` and `recvs` must hold at least one transfer between them, but are "
            "both empty instead."
        )
    sent = [(f"sends[{i}][0]", t) for i, (t, _) in enumerate(checked_sends)]
    received_named = [(f"recvs[{i}][0]", t) for i, (t, _) in enumerate(checked_recvs)]
    # Sends are only read, so they may share memory; a receive is written.
    check_apart(
        [(name, t, False) for name, t in sent] + [(name, t, True) for name, t in received_named]
    )
    tensors = sent + received_named
    received = [t for t, _ in checked_recvs]
    return (
        "exchange",
        tensors,
        received,
        lambda done: backend.start_exchange(checked_sends, checked_recvs, done),
        None,
    )
