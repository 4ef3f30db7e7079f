"""The public collectives of every gang, on top of a few primitives (``_start_*``).

Rules (the scheduling rules are in ``_issuing``, coalescing in ``_coalesce``):
1. Each collective checks its input, naming the parameter, before anything is issued;
   then it hands one primitive start to the scheduler, with the fingerprint that order
   checking compares across ranks (collectives only: send and recv are not checked).
2. The object collectives take two phases (sizes, then bytes) and hold the scheduler's
   gate between them, so later ops start after their second phase on every rank.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from typing_extensions import override

from agang import _objects
from agang._coalesce import current_owner
from agang._coalescing_gang import CoalescingGang, describe, start_guarded
from agang._handle import Handle
from agang._issuing import Done, Start
from agang._reduce_op import ReduceOp
from agang._validate import (
    check_rank,
    check_reduce_dtype,
    check_reduce_op,
    check_same_dtype,
    check_shape,
    check_tensor_list,
)


class BaseGang(CoalescingGang):
    """Implements the public collectives on top of a few primitives (``_start_*``)."""

    # Primitives the implementations provide. Each starts the op and calls ``done``
    # exactly once, from any thread, when the backend has finished with the tensors.

    @abstractmethod
    def _start_all_gather(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        """``output`` is flat: ``size`` runs shaped like ``input``."""

    @abstractmethod
    def _start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None: ...

    @abstractmethod
    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        """``input`` is flat: ``size`` runs shaped like ``output``; it must stay unchanged."""

    @abstractmethod
    def _start_broadcast(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_all_to_all(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None: ...

    @abstractmethod
    def _start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_barrier(self, done: Done) -> None: ...

    # Collectives.

    @override
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        if op is not ReduceOp.SUM:  # SUM is valid for every dtype a backend takes
            op = check_reduce_op(op)
            check_reduce_dtype(tensor, op, name="tensor")
        if self._scopes:
            scope = self._scopes.get(current_owner())
            if scope is not None:
                return self._hold(scope, tensor, op, timeout)
        return self._issue(
            "all_reduce",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_all_reduce(tensor, op, done),
            fingerprint=f"all_reduce({op.name}, {describe(tensor)})",
        )

    @override
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        check_same_dtype(output, input)
        check_shape(output, (self._size, *input.shape), name="output")
        flat = output.view(-1)
        return self._issue(
            "all_gather",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_all_gather(flat, input, done),
            fingerprint=f"all_gather({describe(input)})",
        )

    @override
    def all_gather_to_list(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        input = self._check_tensor(input, "input")
        items = check_tensor_list(outputs, name="outputs", length=self._size)
        checked = [self._check_tensor(t, f"outputs[{i}]") for i, t in enumerate(items)]
        for i, output in enumerate(checked):
            check_same_dtype(output, input)
            check_shape(output, input.shape, name=f"outputs[{i}]")
        busy = [(f"outputs[{i}]", t) for i, t in enumerate(checked)] + [("input", input)]
        return self._issue(
            "all_gather_to_list",
            busy,
            checked,
            timeout,
            lambda done: self._start_all_gather_to_list(checked, input, done),
            fingerprint=f"all_gather_to_list({describe(input)})",
        )

    @override
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        op = check_reduce_op(op)
        check_same_dtype(output, input)
        check_reduce_dtype(input, op, name="input")
        check_shape(input, (self._size, *output.shape), name="input")
        flat = input.view(-1)
        return self._issue(
            "reduce_scatter",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_reduce_scatter(output, flat, op, done),
            fingerprint=f"reduce_scatter({op.name}, {describe(input)})",
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self._size, name="source_rank")
        return self._issue(
            "broadcast",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_broadcast(tensor, source_rank, done),
            fingerprint=f"broadcast(source_rank={source_rank}, {describe(tensor)})",
        )

    @override
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        check_same_dtype(output, input)
        check_shape(output, input.shape, name="output")
        if input.dim() == 0 or input.shape[0] % self._size:
            raise ValueError(
                f"`input` must have a first dimension that is a multiple of the gang's size "
                f"({self._size}), but has shape {tuple(input.shape)} instead."
            )
        return self._issue(
            "all_to_all",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_all_to_all(output, input, done),
            fingerprint=f"all_to_all({describe(input)})",
        )

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        tensor = self._check_tensor(tensor, "tensor")
        destination_rank = check_rank(
            destination_rank, self._size, name="destination_rank", self_rank=self._rank
        )
        return self._issue(
            "send",
            [("tensor", tensor)],
            None,
            timeout,
            lambda done: self._start_send(tensor, destination_rank, done),
        )

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self._size, name="source_rank", self_rank=self._rank)
        return self._issue(
            "recv",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_recv(tensor, source_rank, done),
        )

    @override
    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        return self._issue(
            "barrier", [], None, timeout, self._start_barrier, fingerprint="barrier()"
        )

    @override
    def broadcast_objects(
        self, objects: list[Any], source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[list[Any]]:
        if not isinstance(objects, list):
            raise TypeError(
                f"`objects` must be a list, but is of type `{type(objects).__name__}` instead."
            )
        source_rank = check_rank(source_rank, self._size, name="source_rank")
        is_source = self._rank == source_rank
        payload = _objects.to_bytes(objects, name="objects") if is_source else None
        length = _objects.length_tensor(payload, self._device)

        def phase2(start: Callable[[Start, Callable[[], Any]], None]) -> None:
            buffer = _objects.byte_buffer(payload, int(length.item()), self._device)
            start(
                lambda done: self._start_broadcast(buffer, source_rank, done),
                lambda: objects if is_source else _objects.replace(objects, buffer),
            )

        return self._issue_two_phase(
            "broadcast_objects",
            timeout,
            len(payload or b""),
            lambda done: self._start_broadcast(length, source_rank, done),
            phase2,
            fingerprint=f"broadcast_objects(source_rank={source_rank})",
        )

    @override
    def all_gather_objects(self, obj: Any, *, timeout: float | None = None) -> Handle[list[Any]]:
        payload = _objects.to_bytes(obj, name="obj")
        length = _objects.length_tensor(payload, self._device)
        lengths = torch.zeros(self._size, dtype=torch.int64, device=self._device)

        def phase2(start: Callable[[Start, Callable[[], Any]], None]) -> None:
            longest = int(lengths.max().item())
            buffer = _objects.byte_buffer(payload, longest, self._device)
            gathered = torch.empty(self._size * longest, dtype=torch.uint8, device=self._device)
            start(
                lambda done: self._start_all_gather(gathered, buffer, done),
                lambda: _objects.split(gathered, lengths, longest),
            )

        return self._issue_two_phase(
            "all_gather_objects",
            timeout,
            len(payload),
            lambda done: self._start_all_gather(lengths, length, done),
            phase2,
            fingerprint="all_gather_objects()",
        )

    def _issue_two_phase(
        self,
        op: str,
        timeout: float | None,
        num_bytes: int,
        phase1: Start,
        phase2: Callable[[Callable[[Start, Callable[[], Any]], None]], None],
        *,
        fingerprint: str,
    ) -> Handle[Any]:
        """Issues an op whose second step depends on the first one's result (rule 2)."""
        if self._scopes:
            self._flush_scope_of(current_owner())
        handle, _ = self._new_handle(op, timeout, [], num_bytes)

        def fail(error: BaseException | None) -> None:
            self._complete(handle, None, error)

        def start_second(start: Start, result: Callable[[], Any]) -> None:
            def done(error: BaseException | None) -> None:
                if error is not None:
                    self._complete(handle, None, error)
                    return
                try:
                    value = result()
                except Exception as exc:  # a payload that does not unpickle
                    self._complete(handle, None, exc)
                    return
                self._complete(handle, value, None)

            start_guarded(start, done)

        def after_first(error: BaseException | None) -> None:
            if error is not None:
                self._complete(handle, None, error)
                return
            with self._lock:
                if self._broken is None and not self._closed:
                    phase2(start_second)
                self._scheduler.release_gate(handle.seq)
                self._drain()

        self._admit(
            handle,
            lambda: start_guarded(phase1, after_first),
            fail,
            fingerprint=fingerprint,
            holds_gate=True,
        )
        return handle
