"""What each op of ``FakeWorld`` computes once every member has arrived at it.

Each function takes every member's arrival, in rank order, and writes the results into
the members' tensors (under ``torch.no_grad``, by the caller). One that raises fails
the op on every member with its error, as a mismatch the members could not see alone
(uneven blocks whose sizes two ranks disagree on) does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agang._backends.contract import Done
from agang._backends.sim_nccl.reduce import reduce_tensors
from agang._errors import GangError


@dataclass
class Arrival:
    """One member's arrival at a meeting: its op, what must agree, its tensors."""

    rank: int
    kind: str
    key: tuple[Any, ...]  # what every member must agree on
    args: tuple[Any, ...]
    done: Done


def _all_reduce(arrivals: list[Arrival]) -> None:
    op = arrivals[0].key[0]
    result = reduce_tensors([a.args[0] for a in arrivals], op)
    for a in arrivals:
        a.args[0].copy_(result)


def _all_gather(arrivals: list[Arrival]) -> None:
    inputs = [a.args[1].reshape(-1) for a in arrivals]
    for a in arrivals:
        a.args[0].view(len(arrivals), -1).copy_(torch.stack(inputs))


def _all_gather_to_list(arrivals: list[Arrival]) -> None:
    inputs = [a.args[1] for a in arrivals]
    for a in arrivals:
        for output, value in zip(a.args[0], inputs, strict=True):
            output.copy_(value)


def _reduce_scatter(arrivals: list[Arrival]) -> None:
    op = arrivals[0].key[0]
    size = len(arrivals)
    for a in arrivals:
        chunks = [b.args[1].view(size, -1)[a.rank] for b in arrivals]
        a.args[0].view(-1).copy_(reduce_tensors(chunks, op))


def _broadcast(arrivals: list[Arrival]) -> None:
    source = arrivals[arrivals[0].key[0]].args[0].clone()
    for a in arrivals:
        a.args[0].copy_(source)


def _all_gather_uneven(arrivals: list[Arrival]) -> None:
    gathered = torch.cat([a.args[1] for a in arrivals])
    for a in arrivals:
        a.args[0].copy_(gathered)


def _all_to_all(arrivals: list[Arrival]) -> None:
    if len(arrivals[0].args) == 4:
        _all_to_all_split(arrivals)
        return
    size = len(arrivals)
    inputs = [a.args[1].reshape(size, -1).clone() for a in arrivals]
    for a in arrivals:
        a.args[0].reshape(size, -1).copy_(torch.stack([inputs[j][a.rank] for j in range(size)]))


def _all_to_all_split(arrivals: list[Arrival]) -> None:
    """Rank i's block j goes to rank j's block i; the two must have as many rows, which
    c10d leaves unchecked (Gloo: rows left unwritten, or a killed process)."""
    wrong = [
        f"rank {i} sends {sender.args[3][j]} rows to rank {j}, which expects {receiver.args[2][i]}"
        for i, sender in enumerate(arrivals)
        for j, receiver in enumerate(arrivals)
        if sender.args[3][j] != receiver.args[2][i]
    ]
    if wrong:
        raise GangError(f"The ranks' split sizes of all_to_all disagree: {'; '.join(wrong)}.")
    blocks = [a.args[1].split_with_sizes(a.args[3]) for a in arrivals]
    for j, a in enumerate(arrivals):
        a.args[0].copy_(torch.cat([sent[j] for sent in blocks]))


def _reduce(arrivals: list[Arrival]) -> None:
    op, destination = arrivals[0].key[0], arrivals[0].key[1]
    arrivals[destination].args[0].copy_(reduce_tensors([a.args[0] for a in arrivals], op))


def _gather(arrivals: list[Arrival]) -> None:
    outputs = arrivals[arrivals[0].key[0]].args[0]
    for output, a in zip(outputs, arrivals, strict=True):
        output.copy_(a.args[1])


def _scatter(arrivals: list[Arrival]) -> None:
    inputs = arrivals[arrivals[0].key[0]].args[1]
    for a, input in zip(arrivals, inputs, strict=True):
        a.args[0].copy_(input)


def _nothing(arrivals: list[Arrival]) -> None:
    pass


COMPUTE: dict[str, Callable[[list[Arrival]], None]] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "all_gather_to_list": _all_gather_to_list,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
    "all_gather_uneven": _all_gather_uneven,
    "reduce": _reduce,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _nothing,
}
