"""The rooted collectives of :class:`agang.Gang`: reduce, gather and scatter.

They are a part of ``CollectiveGang`` (which inherits this mixin), kept apart because
one rank, the root, plays another role than the others: it alone receives the
reduction (``reduce``), receives every rank's block (``gather``) or sends one block to
every rank (``scatter``). The tensor only the root uses must be None elsewhere, so a
call that mixes up the roles fails at once, naming it, instead of being ignored.

Each call is checked, then issued as every collective is (``CollectiveGang._issue``:
timeout, coalescer flush, engine), with a fingerprint naming the root, so ranks that
disagree on it fail the order check. The root's blocks go to the backend as views of
its stacked or concatenated tensor, one per rank, as c10d takes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from agang._backends.contract import Backend
from agang._engine.coalescer import describe
from agang._engine.ops import Fingerprint, Start
from agang._handle import Handle
from agang._reduce_op import ReduceOp
from agang._validate import (
    check_rank,
    check_reduce_dtype,
    check_reduce_op,
    check_root_only,
    check_same_dtype,
    check_stacked_or_concatenated,
)


def blocks(tensor: torch.Tensor, size: int, part: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``tensor``'s ``size`` blocks shaped ``part``, in rank order; ``tensor``
    is stacked or concatenated (both are the same bytes in the same order)."""
    return list(tensor.view(size, *part).unbind(0))


class IssuingGang(Protocol):
    """What the collective mixins (this one and ``agang._collective.uneven``'s) use of
    ``CollectiveGang``: its ranks, backend and issue path."""

    _backend: Backend

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def _check_tensor(self, tensor: object, name: str) -> torch.Tensor:
        """``tensor``, checked for this gang's device and backend."""

    def _issue(
        self,
        op: str,
        tensors: Sequence[tuple[str, torch.Tensor]],
        output: Any,
        timeout: float | None,
        start: Start,
        *,
        fingerprint: Fingerprint | None = None,
    ) -> Handle[Any]:
        """Issues one backend op whose handle finishes with ``output``."""


def _root_tensor(
    gang: IssuingGang, tensor: torch.Tensor | None, block: torch.Tensor, *, is_root: bool, name: str
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The root-only ``tensor`` (gather's output, scatter's input), checked, and views
    of its per-rank blocks shaped like ``block``; (None, None) off the root."""
    root = "destination rank" if name == "output" else "source rank"
    check_root_only(tensor, is_root=is_root, name=name, root=root)
    if tensor is None:
        return None, None
    tensor = gang._check_tensor(tensor, name)
    output, input = (tensor, block) if name == "output" else (block, tensor)
    check_same_dtype(output, input)
    check_stacked_or_concatenated(tensor, gang.size, block.shape, name=name)
    return tensor, blocks(tensor, gang.size, block.shape)


class RootedCollectives:
    """``reduce``, ``gather`` and ``scatter`` of :class:`agang.Gang`, for
    ``CollectiveGang`` (a plain mixin, not a Gang: the gang classes stay one level deep
    under ``CollectiveGang``); their documentation is the Gang's."""

    def reduce(
        self: IssuingGang,
        tensor: torch.Tensor,
        destination_rank: int,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        destination_rank = check_rank(destination_rank, self.size, name="destination_rank")
        op = check_reduce_op(op)
        check_reduce_dtype(tensor, op, name="tensor")
        backend = self._backend
        return self._issue(
            "reduce",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: backend.start_reduce(tensor, destination_rank, op, done),
            fingerprint=lambda: (
                f"reduce({op.name}, destination_rank={destination_rank}, {describe(tensor)})"
            ),
        )

    def gather(
        self: IssuingGang,
        output: torch.Tensor | None,
        input: torch.Tensor,
        destination_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor | None]:
        input = self._check_tensor(input, "input")
        destination_rank = check_rank(destination_rank, self.size, name="destination_rank")
        output, outputs = _root_tensor(
            self, output, input, is_root=self.rank == destination_rank, name="output"
        )
        tensors = [("input", input)] if output is None else [("output", output), ("input", input)]
        backend = self._backend
        return self._issue(
            "gather",
            tensors,
            output,
            timeout,
            lambda done: backend.start_gather(outputs, input, destination_rank, done),
            fingerprint=lambda: f"gather(destination_rank={destination_rank}, {describe(input)})",
        )

    def scatter(
        self: IssuingGang,
        output: torch.Tensor,
        input: torch.Tensor | None,
        source_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        output = self._check_tensor(output, "output")
        source_rank = check_rank(source_rank, self.size, name="source_rank")
        input, inputs = _root_tensor(
            self, input, output, is_root=self.rank == source_rank, name="input"
        )
        tensors = [("output", output)] if input is None else [("output", output), ("input", input)]
        backend = self._backend
        return self._issue(
            "scatter",
            tensors,
            output,
            timeout,
            lambda done: backend.start_scatter(output, inputs, source_rank, done),
            fingerprint=lambda: f"scatter(source_rank={source_rank}, {describe(output)})",
        )
