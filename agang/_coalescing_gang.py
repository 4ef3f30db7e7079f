"""The gang layer that issues ops and groups all-reduces: scopes, buckets and lanes.

The grouping rules are in ``_coalesce``; the scheduling rules in ``_issuing``. Lanes
are gangs over the same ranks with a communicator and an order of their own, made once
per name (a collective call on this gang) and closed with it.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar, overload

import torch
from typing_extensions import override

from agang import _busy
from agang._coalesce import (
    HELD,
    Coalesced,
    FlatBuffers,
    Member,
    Scope,
    all_of,
    current_owner,
    failed,
    group_members,
    group_timeout,
    plan_buckets,
)
from agang._gang import Gang
from agang._handle import Handle, finish_all
from agang._issuing import Done, IssuingGang, Start
from agang._policy import GangPolicy
from agang._reduce_op import ReduceOp
from agang._validate import (
    check_distinct,
    check_positive_int,
    check_reduce_dtype,
    check_reduce_op,
    check_tensor,
    check_tensor_list,
)

T = TypeVar("T")

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def describe(tensor: torch.Tensor) -> str:
    """A tensor's dtype and shape, as fingerprints show it: ``float32[4, 2]``."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


class CoalescingGang(IssuingGang):
    """Issuing ops, with all-reduces grouped by scopes and buckets, and lanes."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        device: torch.device,
        backend: str,
        name: str,
        policy: GangPolicy,
    ) -> None:
        super().__init__(
            rank=rank, size=size, device=device, backend=backend, name=name, policy=policy
        )
        self._scopes: dict[object, Scope] = {}
        self._lanes: dict[str, tuple[bool, Handle[Gang]]] = {}
        self._buffers = FlatBuffers()

    @abstractmethod
    def _start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        """Starts the reduction; ``post`` runs once it is done, before ``done``, and on
        CUDA in stream order (``_coalesce`` rule 4 copies the flat result back there)."""

    @abstractmethod
    async def _create_lane(self, name: str, *, high_priority: bool) -> CoalescingGang:
        """Makes the lane gang (a collective call on this gang)."""

    def _check_tensor(self, tensor: object, name: str) -> torch.Tensor:
        return check_tensor(tensor, name=name, device=self._device, backend=self._backend)

    def _mark_closed(self) -> None:
        super()._mark_closed()
        self._buffers.clear()

    # Issuing.

    def _issue(
        self,
        op: str,
        busy: Sequence[tuple[str, torch.Tensor]],
        output: T,
        timeout: float | None,
        start: Start,
        *,
        fingerprint: str | None = None,
    ) -> Handle[T]:
        if self._scopes:
            self._flush_scope_of(current_owner())  # program order across kinds (rule 6)
        handle, claim = self._new_handle(op, timeout, busy)

        def done(error: BaseException | None) -> None:
            _busy.release(claim)
            self._complete(handle, output, error)

        self._admit(handle, lambda: start_guarded(start, done), done, fingerprint=fingerprint)
        return handle

    # Coalescing (see ``_coalesce``).

    @override
    @contextlib.contextmanager
    def coalesce(self) -> Iterator[Coalesced]:
        owner = current_owner()
        with self._lock:
            scope = self._scopes.get(owner)
            if scope is not None:
                scope.depth += 1  # nested scopes join the outermost one
            else:
                self._check_usable()
                scope = self._scopes[owner] = Scope(owner)
        try:
            yield scope.issued
        finally:
            with self._lock:
                scope.depth -= 1
                last = scope.depth == 0
                if last:
                    del self._scopes[owner]
            if last:
                # Also on an exception: the held ops were issued as far as the caller
                # and the other ranks know, so they are started, not dropped.
                issued = scope.issued
                self._issue_members(scope.take(), issued)
                issued._all = all_of(issued._flats, issued._tensors, op="coalesce")

    def _hold(
        self, scope: Scope, tensor: torch.Tensor, op: ReduceOp, timeout: float | None
    ) -> Handle[torch.Tensor]:
        if self._closed or self._broken is not None:
            self._check_usable()
        seconds = self._op_timeout if timeout is None else self._resolve_timeout(timeout)
        handle: Handle[torch.Tensor] = Handle(
            op="all_reduce",
            seq=-1,  # numbered when the scope ends
            num_bytes=tensor.nbytes,
            timeout=seconds,
        )
        claim = _busy.acquire_one("tensor", tensor, handle)
        handle._hold = HELD
        handle._before_wait = self._rearm_for_waiter
        scope.members.append(Member(tensor, op, tensor.dtype, seconds, handle, claim))
        scope.issued.handles.append(handle)
        scope.issued._tensors.append(tensor)
        return handle

    def _flush_scope_of(self, owner: object) -> None:
        scope = self._scopes.get(owner)
        if scope is not None and scope.members:
            self._issue_members(scope.take(), scope.issued)

    def _issue_members(self, members: list[Member], issued: Coalesced) -> None:
        for group in group_members(members):
            tensors = [m.tensor for m in group]
            claims = [m.claim for m in group]
            timeout = group_timeout([m.timeout for m in group])
            try:
                flat = self._issue_flat(tensors, group[0].op, timeout, claims)
            except Exception as exc:  # the gang was closed or broke meanwhile
                _busy.release_all(claims)
                for member in group:
                    member.handle._hold = None
                    member.handle._finish(None, exc)
                issued._flats.append(failed("all_reduce", exc))
                continue
            issued._flats.append(flat)
            if len(group) > 1:
                with self._lock:
                    self._counters.num_coalesced += len(group)
            seq = flat.seq
            for member in group:
                handle = member.handle
                handle.seq = seq
                handle._hold = None
            flat._add_done_callback(_finisher(flat, group))

    def _issue_flat(
        self,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        timeout: float | None,
        claims: list[_busy.Claim],
    ) -> Handle[list[torch.Tensor]]:
        """One all-reduce over ``tensors``, whose memory ``claims`` hold (rule 4)."""
        num_bytes = sum([t.nbytes for t in tensors])
        handle, _ = self._new_handle(
            "all_reduce", float("inf") if timeout is None else timeout, [], num_bytes
        )
        if len(tensors) == 1:
            flat, post = tensors[0], None
        else:
            packed = self._buffers.pack(tensors)
            flat = packed.flat

            def post() -> None:
                self._buffers.unpack(packed, tensors)  # c10d is done with the buffer

        def done(error: BaseException | None) -> None:
            _busy.release_all(claims)
            self._complete(handle, tensors, error)

        self._admit(
            handle,
            lambda: start_guarded(lambda d: self._start_all_reduce(flat, op, d, post), done),
            done,
            fingerprint=f"all_reduce({op.name}, {describe(flat)})",
        )
        return handle

    # The overloads repeat the ABC's: mypy refuses a plain override of an overloaded
    # method whose return is the union.
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
        if not isinstance(per_bucket, bool):
            raise TypeError(
                f"`per_bucket` must be a bool, but is of type `{type(per_bucket).__name__}` "
                f"instead."
            )
        seconds = self._resolve_timeout(timeout) if timeout is not None else self._op_timeout
        self._check_usable()
        if self._scopes:
            self._flush_scope_of(current_owner())
        keys = [((t.dtype, t.device), t.numel() * t.element_size()) for t in checked]
        buckets = plan_buckets(keys, bucket_bytes)
        # Every bucket's memory is claimed before any is issued: a busy tensor refuses
        # the whole call, and nothing is issued (rule 1).
        claims: list[_busy.Claim] = []
        try:
            for number, bucket in enumerate(buckets):
                holder = _BucketHolder(number)
                pairs = [(f"tensors[{i}]", checked[i]) for i in bucket]
                claims.append(_busy.acquire(pairs, holder))
        except Exception:
            _busy.release_all(claims)
            raise
        handles = []
        for number, bucket in enumerate(buckets):
            members = [checked[i] for i in bucket]
            try:
                handles.append(self._issue_flat(members, op, seconds, [claims[number]]))
            except Exception as exc:  # the gang broke or closed meanwhile
                _busy.release_all(claims[number:])
                handles.append(failed("all_reduce", exc))
                break
        with self._lock:
            self._counters.num_coalesced += sum(len(b) for b in buckets if len(b) > 1)
        if per_bucket:
            return handles
        return all_of(handles, checked, op="all_reduce_bucketed")

    # Lanes.

    @override
    async def lane(self, name: str, *, high_priority: bool = False) -> Gang:
        if not isinstance(name, str) or not name:  # type: ignore[redundant-expr]  # untyped callers
            raise ValueError(f"`name` must be a non-empty str, but is {name!r} instead.")
        if not isinstance(high_priority, bool):
            raise TypeError(
                f"`high_priority` must be a bool, "
                f"but is of type `{type(high_priority).__name__}` instead."
            )
        self._check_usable()
        with self._lock:
            known = self._lanes.get(name)
            if known is None:
                making: Handle[Gang] = Handle(op="lane", seq=-1, num_bytes=0, timeout=None)
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
            lane = await self._create_lane(name, high_priority=high_priority)
        except BaseException as exc:
            with self._lock:
                self._lanes.pop(name, None)
            making._finish(None, exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            raise
        with self._lock:
            self._children.append(lane)
        making._finish(lane, None)
        return lane


class _BucketHolder:
    def __init__(self, number: int) -> None:
        self.number = number

    def __str__(self) -> str:
        return f"bucket {self.number} of this `all_reduce_bucketed` call"


def _finisher(flat: Handle[Any], group: list[Member]) -> Callable[[], None]:
    """Finishes every member of a flat op with its own tensor, or the op's error."""

    def finish_members() -> None:
        error = flat.exception()
        if error is None:
            finish_all([(m.handle, m.tensor) for m in group], None)
        else:
            finish_all([(m.handle, None) for m in group], error)

    return finish_members


def start_guarded(start: Start, done: Done) -> None:
    try:
        start(done)
    except Exception as exc:
        done(exc)
