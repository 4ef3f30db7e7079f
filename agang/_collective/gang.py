"""The one implementation of :class:`agang.Gang`: validation in front of an engine.

A ``CollectiveGang`` is made of parts, each holding the next, with one-way calls:
- the gang checks every call's input, naming the parameter, resolves its timeout once,
  and hands the op to the coalescer (``agang._engine.coalescer``: all-reduces in an open
  ``coalesce()`` scope, bucketed all-reduces) or straight to
- the engine (``agang._engine.engine``): numbers, admits, starts, completes and times
  out ops, breaks and closes the gang, over
- the backend (``agang._backends.contract``), which moves the bytes.

``ProcessGroupGang``, ``FakeGang`` and ``testing.FakeWorldGang`` are this class over
their backend. Sub-gangs and lanes are made here, once, from the backend's children.
Only collectives are order-checked (fingerprint: op, shapes, dtypes, reduce op, root).
The rooted collectives (reduce, gather, scatter) are the mixin ``agang._collective.rooted``'s;
all_gather, all_to_all and exchange (whose blocks may be uneven) ``agang._collective.uneven``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal, Self, overload

import torch
from typing_extensions import override

from agang._backends.contract import Backend
from agang._backends.cuda.runtime import StreamOrder
from agang._collective import objects as _objects
from agang._collective.lanes import Lanes
from agang._collective.rooted import RootedCollectives
from agang._collective.serialize import Serializer
from agang._collective.uneven import ExchangeCollectives
from agang._engine.coalescer import DEFAULT_BUCKET_BYTES, Coalesced, Coalescer, all_of, describe
from agang._engine.engine import Engine
from agang._engine.ops import Fingerprint, Start
from agang._gang import Gang
from agang._handle import Handle
from agang._policy import GangPolicy
from agang._reduce_op import ReduceOp
from agang._runtime.threads import run_all, run_blocking
from agang._statistics import GangStatistics
from agang._validate import (
    check_bool,
    check_distinct,
    check_member_ranks,
    check_non_negative_int,
    check_positive_int,
    check_rank,
    check_reduce_dtype,
    check_reduce_op,
    check_same_dtype,
    check_shape,
    check_stacked_or_concatenated,
    check_tensor,
    check_tensor_list,
    is_usual_tensor,
    supported_dtypes,
)

# How long ``close`` waits for the backend's release at most: on NCCL the release's
# abort waits until this rank's device reached the gang's queued kernels
# (``agang._backends.c10d.abort`` rule 1); past this, close returns and the release
# ends on its thread.
_CLOSE_SECONDS = 5.0
_SUM = ReduceOp.SUM  # an enum member's lookup costs per call


class CollectiveGang(RootedCollectives, ExchangeCollectives, Gang):
    """A gang over a backend: every collective, lanes, sub-gangs, coalescing, closing.

    Args:
        backend: The communicator (``agang._backends.contract.Backend``).
        policy: Timeouts, in-flight bounds and order checking, inherited by children.
    """

    def __init__(self, backend: Backend, policy: GangPolicy) -> None:
        self._backend = backend
        self._device = backend.device
        self._dtypes = supported_dtypes(backend.kind)
        self._engine = Engine(backend, policy)
        self._coalescer = Coalescer(self._engine, backend)
        self._lanes = Lanes(self._engine.lock)
        self._children: list[CollectiveGang] = []

    @classmethod
    def _over(cls, backend: Backend, policy: GangPolicy) -> Self:
        """A gang of this class over a child's ``backend`` (made by the parent's)."""
        gang = cls.__new__(cls)
        CollectiveGang.__init__(gang, backend, policy)
        return gang

    # Properties.

    @property
    @override
    def rank(self) -> int:
        return self._backend.rank

    @property
    @override
    def size(self) -> int:
        return self._backend.size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    @override
    def backend(self) -> str:
        return self._backend.kind

    @property
    @override
    def name(self) -> str:
        return self._backend.name

    @property
    @override
    def closed(self) -> bool:
        return self._engine.closed

    @property
    def policy(self) -> GangPolicy:
        """The gang's timeout, in-flight and order-checking policy."""
        return self._engine.policy

    def stream_order(self) -> StreamOrder | None:
        """Orders device work of code above the gang around its ops; None on a CPU."""
        return self._backend.stream_order()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} '{self.name}' rank {self.rank} of {self.size} "
            f"{self.backend} {self._device}>"
        )

    def _check_tensor(self, tensor: object, name: str) -> torch.Tensor:
        if is_usual_tensor(tensor, self._device, self._dtypes):  # at once, no message made
            return tensor
        return check_tensor(tensor, name=name, device=self._device, backend=self._backend.kind)

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
        engine = self._engine
        seconds = engine.default_seconds if timeout is None else engine.resolve_timeout(timeout)
        if self._coalescer.scopes:
            self._coalescer.flush()  # program order across kinds of op
        return engine.issue(op, tensors, output, seconds, start, fingerprint=fingerprint)

    # Collectives.

    @override
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        if op is not _SUM:  # SUM is valid for every dtype a backend takes
            op = check_reduce_op(op)
            check_reduce_dtype(tensor, op, name="tensor")
        engine = self._engine
        seconds = engine.default_seconds if timeout is None else engine.resolve_timeout(timeout)
        coalescer = self._coalescer
        if coalescer.scopes:  # the common case, no scope open anywhere, costs no call
            scope = coalescer.scope_of_current_owner()
            if scope is not None:
                return coalescer.hold(scope, tensor, op, seconds)
            coalescer.flush()
        backend = self._backend
        return engine.issue(
            "all_reduce",
            [("tensor", tensor)],
            tensor,
            seconds,
            lambda done: backend.start_all_reduce(tensor, op, done),
            fingerprint=lambda: f"all_reduce({op.name}, {describe(tensor)})",
        )

    @override
    def coalesce(self) -> contextlib.AbstractContextManager[Coalesced]:
        return self._coalescer.coalesce()

    # The overloads repeat the ABC's: mypy refuses a plain override of the union.
    @overload
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ...,
        *,
        bucket_bytes: int = ...,
        timeout: float | None = ...,
        per_bucket: Literal[False] = ...,
    ) -> Handle[list[torch.Tensor]]: ...

    @overload
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ...,
        *,
        bucket_bytes: int = ...,
        timeout: float | None = ...,
        per_bucket: Literal[True],
    ) -> list[Handle[list[torch.Tensor]]]: ...

    @override
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout: float | None = None,
        per_bucket: bool = False,
    ) -> Handle[list[torch.Tensor]] | list[Handle[list[torch.Tensor]]]:
        items = check_tensor_list(tensors, name="tensors", length=None)
        checked = [self._check_tensor(t, f"tensors[{i}]") for i, t in enumerate(items)]
        op = check_reduce_op(op)
        for i, tensor in enumerate(checked):
            check_reduce_dtype(tensor, op, name=f"tensors[{i}]")
        check_distinct(checked, name="tensors")
        bucket_bytes = check_positive_int(bucket_bytes, name="bucket_bytes")
        check_bool(per_bucket, name="per_bucket")
        seconds = self._engine.resolve_timeout(timeout)
        handles = self._coalescer.all_reduce_bucketed(checked, op, bucket_bytes, seconds)
        if per_bucket:
            return handles
        return all_of(handles, checked, op="all_reduce_bucketed")

    @override
    def all_gather_to_list(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        input = self._check_tensor(input, "input")
        items = check_tensor_list(outputs, name="outputs", length=self.size)
        checked = [self._check_tensor(t, f"outputs[{i}]") for i, t in enumerate(items)]
        for i, output in enumerate(checked):
            check_same_dtype(output, input)
            check_shape(output, input.shape, name=f"outputs[{i}]")
        tensors = [(f"outputs[{i}]", t) for i, t in enumerate(checked)] + [("input", input)]
        backend = self._backend
        return self._issue(
            "all_gather_to_list",
            tensors,
            checked,
            timeout,
            lambda done: backend.start_all_gather_to_list(checked, input, done),
            fingerprint=lambda: f"all_gather_to_list({describe(input)})",
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
        check_stacked_or_concatenated(input, self.size, output.shape, name="input")
        flat = input.view(-1)
        backend = self._backend
        return self._issue(
            "reduce_scatter",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: backend.start_reduce_scatter(output, flat, op, done),
            fingerprint=lambda: f"reduce_scatter({op.name}, {describe(input)})",
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self.size, name="source_rank")
        backend = self._backend
        return self._issue(
            "broadcast",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: backend.start_broadcast(tensor, source_rank, done),
            fingerprint=lambda: f"broadcast(source_rank={source_rank}, {describe(tensor)})",
        )

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        tensor = self._check_tensor(tensor, "tensor")
        destination_rank = check_rank(
            destination_rank, self.size, name="destination_rank", self_rank=self.rank
        )
        backend = self._backend
        return self._issue(
            "send",
            [("tensor", tensor)],
            None,
            timeout,
            lambda done: backend.start_send(tensor, destination_rank, done),
        )

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self.size, name="source_rank", self_rank=self.rank)
        backend = self._backend
        return self._issue(
            "recv",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: backend.start_recv(tensor, source_rank, done),
        )

    @override
    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        return self._issue(
            "barrier", [], None, timeout, self._backend.start_barrier, fingerprint="barrier()"
        )

    @override
    def broadcast_objects(
        self,
        objects: list[Any],
        source_rank: int = 0,
        *,
        timeout: float | None = None,
        serializer: Serializer = "safe",
    ) -> Handle[list[Any]]:
        _objects.check_objects(objects, serializer)
        source_rank = check_rank(source_rank, self.size, name="source_rank")
        seconds = self._engine.resolve_timeout(timeout)
        phases = _objects.broadcast_phases(
            self._backend, objects, source_rank, self._device, serializer
        )
        self._coalescer.flush()
        return _objects.issue(self._engine, "broadcast_objects", seconds, phases, source_rank)

    @override
    def all_gather_objects(
        self, obj: Any, *, timeout: float | None = None, serializer: Serializer = "safe"
    ) -> Handle[list[Any]]:
        seconds = self._engine.resolve_timeout(timeout)
        phases = _objects.all_gather_phases(self._backend, obj, self._device, serializer)
        self._coalescer.flush()
        return _objects.issue(self._engine, "all_gather_objects", seconds, phases)

    @override
    async def wait_for_room(self, num_bytes: int = 0) -> None:
        await self._engine.wait_for_room(check_non_negative_int(num_bytes, name="num_bytes"))

    # Sub-gangs and lanes: the backend's children, made here once.

    @override
    async def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        members = check_member_ranks(ranks, self.size)
        return await self._create_child(members, name=f"{self.name}{members}")

    @override
    async def lane(self, name: str, *, high_priority: bool = False) -> Gang:
        if not isinstance(name, str) or not name:  # type: ignore[redundant-expr]  # untyped callers
            raise ValueError(f"`name` must be a non-empty str, but is {name!r} instead.")
        check_bool(high_priority, name="high_priority")
        self._engine.check_usable()
        members, lane_name = list(range(self.size)), f"{self.name}/lane:{name}"
        return await self._lanes.get_or_make(
            name,
            high_priority,
            lambda: self._create_child(members, name=lane_name, high_priority=high_priority),
        )

    async def _create_child(
        self, members: list[int], *, name: str, high_priority: bool = False
    ) -> CollectiveGang | None:
        """A collective call on this gang's ranks; a child gang on ``members``."""
        self._engine.check_usable()
        self._coalescer.flush()
        backend = await self._backend.create_child(
            members,
            name=name,
            high_priority=high_priority,
            seconds=self._engine.policy.op_timeout,
        )
        if backend is None:
            return None
        child = self._over(backend, self._engine.policy)
        with self._engine.lock:
            if not (orphan := self._engine.closed):
                self._children.append(child)
        if orphan:  # this gang was closed meanwhile: its child must not outlive it
            await child.close()
            self._engine.check_usable()  # raises GangClosedError
        return child

    # Closing: this gang and its children, marked closed at once, released off the loop.

    def _mark_closed(self) -> None:
        if not self._engine.mark_closed():
            return
        self._coalescer.clear()
        with self._engine.lock:
            children = list(self._children)
        for child in children:
            child._mark_closed()

    def _release(self) -> None:
        with self._engine.lock:
            children = list(self._children)
        run_all([c._release for c in children], name=f"release sub-gangs of '{self.name}'")
        self._engine.release()

    @override
    async def close(self) -> None:
        if self.closed:
            return
        self._mark_closed()
        await run_blocking(self._release, name=f"close gang '{self.name}'", seconds=_CLOSE_SECONDS)

    @override
    def close_sync(self) -> None:
        if self.closed:
            return
        self._mark_closed()
        self._release()

    @override
    def statistics(self) -> GangStatistics:
        return self._engine.statistics()
