"""The one implementation of [`agang.Gang`][agang.Gang]: checks in front of an engine.

A ``CollectiveGang`` is made of parts, each holding the next, with one-way calls:
- the gang checks every call's input, naming the parameter, resolves its timeout once,
  and hands the op to the coalescer (``agang._engine.coalescer``: all-reduces in an open
  ``coalesce()`` scope, bucketed all-reduces) or straight to
- the engine (``agang._engine.engine``): numbers, admits, starts, completes and times
  out ops, breaks and closes the gang, over
- the backend (``agang._backends.contract``), which moves the bytes.

Every collective but ``all_reduce`` is one line here: a function of its family
(``even``, ``rooted``, ``uneven``, ``objects``) checks the call against the gang's
``Group`` and describes it as an ``Op``, which the gang issues. ``all_reduce`` keeps an
inline path: it is the most frequent call, and it decides whether an open scope holds it.
Only collectives are order-checked (fingerprint: op, shapes, dtypes, reduce op, root).

``ProcessGroupGang``, ``FakeGang`` and ``testing.FakeWorldGang`` are this class over
their backend. Sub-gangs and lanes are made here, once, from the backend's children,
each a gang of the parent's class made by ``gang_over``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import torch
from typing_extensions import override

from agang._backends.contract import Backend
from agang._backends.cuda.runtime import StreamOrder
from agang._backends.fingerprint import describe
from agang._collective import even, rooted, uneven
from agang._collective import objects as object_ops
from agang._collective.checks import Group, check_reduce_dtype
from agang._engine import busy
from agang._engine.coalescer import DEFAULT_BUCKET_BYTES, Coalescer
from agang._engine.engine import Engine
from agang._engine.ops import Op
from agang._gang import Gang, Serializer, Transfer
from agang._handle import Coalesced, Handle, all_of
from agang._policy import GangPolicy
from agang._reduce_op import ReduceOp
from agang._runtime.future import Future, finish
from agang._runtime.threads import run_all, run_blocking
from agang._statistics import GangStatistics
from agang._validate import (
    check_bool,
    check_member_ranks,
    check_non_negative_int,
    check_positive_int,
    check_reduce_op,
)

# How long ``close`` waits for the backend's release at most: on NCCL the release's
# abort waits until this rank's device reached the gang's queued kernels
# (``agang._backends.c10d.abort`` rule 1); past this, close returns and the release
# ends on its thread.
_CLOSE_SECONDS = 5.0
_SUM = ReduceOp.SUM  # an enum member's lookup costs per call

G = TypeVar("G", bound="CollectiveGang")


class CollectiveGang(Gang):
    """A gang over a backend: every collective, lanes, sub-gangs, coalescing, closing.

    Args:
        backend: The communicator (``agang._backends.contract.Backend``).
        policy: Timeouts, in-flight bounds and order checking, inherited by children.
    """

    def __init__(self, backend: Backend, policy: GangPolicy) -> None:
        self._backend = backend
        self._group = Group.of(backend)
        self._engine = Engine(backend, policy)
        self._coalescer = Coalescer(self._engine, backend)
        # Lanes by name: each made once, on first call, and shared by later calls. Two
        # tasks asking for one name at once get one lane: the first registers a future
        # that the others await. A failed making is forgotten, so a later call may retry.
        self._lanes: dict[str, tuple[bool, Future[Gang]]] = {}
        self._children: list[CollectiveGang] = []

    # Properties.

    @property
    @override
    def rank(self) -> int:
        return self._group.rank

    @property
    @override
    def size(self) -> int:
        return self._group.size

    @property
    @override
    def device(self) -> torch.device:
        return self._group.device

    @property
    @override
    def backend(self) -> str:
        return self._group.kind

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

    @override
    def _stream_order(self) -> StreamOrder | None:
        return self._backend.stream_order()

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} '{self.name}' rank {self.rank} of {self.size} "
            f"{self.backend} {self.device}>"
        )

    # Collectives: each is checked and described by its family's function (``even``,
    # ``rooted``, ``uneven``, ``objects``) and issued here; all_reduce has its own path.

    def _issue(self, op: Op, timeout: float | None) -> Handle[Any]:
        engine = self._engine
        seconds = engine.default_seconds if timeout is None else engine.resolve_timeout(timeout)
        if self._coalescer.scopes:
            self._coalescer.flush()  # program order across kinds of op
        name, tensors, output, start, fingerprint = op
        return engine.issue(name, tensors, output, seconds, start, fingerprint=fingerprint)

    def _issue_objects(self, phases: object_ops.Phases, timeout: float | None) -> Handle[list[Any]]:
        seconds = self._engine.resolve_timeout(timeout)
        self._coalescer.flush()
        handle: Handle[list[Any]] = self._engine.issue_two_phase(
            phases.name,
            seconds,
            phases.num_bytes,
            phases.first,
            phases.second,
            fingerprint=phases.fingerprint,
        )
        if phases.refused is not None:
            # Issued all the same, so the other ranks learn of it; the gang stays usable.
            raise phases.refused
        return handle

    @override
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        # The hot path, inline: checks cheapest first (the usual tensor builds no message,
        # SUM needs no dtype check), and the fingerprint's text is made only when asked.
        tensor = self._group.tensor(tensor, "tensor")
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
            # A closure, made into text only where it is compared (rule 8 of the engine)
            # or a peer's blame asks about this op.
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
        checked, op = even.bucketed(self._group, tensors, op)
        bucket_bytes = check_positive_int(bucket_bytes, name="bucket_bytes")
        check_bool(per_bucket, name="per_bucket")
        seconds = self._engine.resolve_timeout(timeout)
        handles = self._coalescer.all_reduce_bucketed(checked, op, bucket_bytes, seconds)
        if per_bucket:
            return handles
        return all_of(handles, checked, op="all_reduce_bucketed")

    @override
    def all_gather_to_list(
        self, outputs: Sequence[torch.Tensor], input: torch.Tensor, *, timeout: float | None = None
    ) -> Handle[list[torch.Tensor]]:
        return self._issue(
            even.all_gather_to_list(self._group, self._backend, outputs, input), timeout
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
        return self._issue(
            even.reduce_scatter(self._group, self._backend, output, input, op), timeout
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        return self._issue(even.broadcast(self._group, self._backend, tensor, source_rank), timeout)

    @override
    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        return self._issue(even.barrier(self._backend), timeout)

    @override
    def reduce(
        self,
        tensor: torch.Tensor,
        destination_rank: int,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        return self._issue(
            rooted.reduce(self._group, self._backend, tensor, destination_rank, op), timeout
        )

    @override
    def gather(
        self,
        output: torch.Tensor | None,
        input: torch.Tensor,
        destination_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor | None]:
        return self._issue(
            rooted.gather(self._group, self._backend, output, input, destination_rank), timeout
        )

    @override
    def scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor | None,
        source_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        return self._issue(
            rooted.scatter(self._group, self._backend, output, input, source_rank), timeout
        )

    @override
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        return self._issue(
            uneven.all_gather(self._group, self._backend, output, input, output_split_sizes),
            timeout,
        )

    @override
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        return self._issue(
            uneven.all_to_all(
                self._group, self._backend, output, input, output_split_sizes, input_split_sizes
            ),
            timeout,
        )

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        return self._issue(
            uneven.send(self._group, self._backend, tensor, destination_rank), timeout
        )

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        return self._issue(uneven.recv(self._group, self._backend, tensor, source_rank), timeout)

    @override
    def exchange(
        self,
        sends: Sequence[Transfer] = (),
        recvs: Sequence[Transfer] = (),
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        return self._issue(uneven.exchange(self._group, self._backend, sends, recvs), timeout)

    @override
    def broadcast_objects(
        self,
        objects: list[Any],
        source_rank: int = 0,
        *,
        timeout: float | None = None,
        serializer: Serializer = "safe",
    ) -> Handle[list[Any]]:
        return self._issue_objects(
            object_ops.broadcast_objects(
                self._group, self._backend, objects, source_rank, serializer
            ),
            timeout,
        )

    @override
    def all_gather_objects(
        self, obj: Any, *, timeout: float | None = None, serializer: Serializer = "safe"
    ) -> Handle[list[Any]]:
        return self._issue_objects(
            object_ops.all_gather_objects(self._group, self._backend, obj, serializer), timeout
        )

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
        return await self._lane(
            name,
            high_priority,
            lambda: self._create_child(members, name=lane_name, high_priority=high_priority),
        )

    async def _lane(
        self, name: str, high_priority: bool, make: Callable[[], Awaitable[Gang | None]]
    ) -> Gang:
        """The lane ``name``, made by ``make()`` if no call made (or is making) it."""
        with self._engine.lock:
            known = self._lanes.get(name)
            if known is None:
                making: Future[Gang] = Future(f"lane '{name}'")
                self._lanes[name] = (high_priority, making)
        if known is not None:
            priority, made = known
            if priority != high_priority:
                raise ValueError(
                    f"`high_priority` must match the lane '{name}' made earlier "
                    f"({priority}), but is {high_priority} instead."
                )
            return await made
        try:
            lane = await make()
        except BaseException as exc:
            with self._engine.lock:
                self._lanes.pop(name, None)
            finish(making, None, exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            raise
        assert lane is not None  # every rank is a member of a lane
        finish(making, lane, None)
        return lane

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
        child = gang_over(type(self), backend, self._engine.policy)
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

    @override
    def holds(self, tensor: torch.Tensor) -> bool:
        # The busy ranges are process-wide: an op of another gang on the same memory
        # counts too, which only makes the answer safer.
        return busy.is_busy(tensor)


def gang_over(cls: type[G], backend: Backend, policy: GangPolicy) -> G:
    """The children's constructor: a gang of class ``cls`` over ``backend``, a child of a
    gang's backend (a sub-gang, a lane) or a backend made apart from the class's own
    constructor (a ``DeviceMesh``'s group, an epoch's Gloo group). It skips the subclass's
    constructor, whose arguments only a root gang has, and so must stay all a gang needs."""
    gang = cls.__new__(cls)
    CollectiveGang.__init__(gang, backend, policy)
    return gang
