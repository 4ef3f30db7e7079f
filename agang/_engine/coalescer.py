"""The coalescer of one gang: ``coalesce()`` scopes, flat ops and bucketed all-reduces.

It follows the grouping rules of ``grouping`` (program order only; groups; buckets;
flat ops; scopes belong to a task; other ops flush the scope; no wait inside a scope).
It is given the gang's engine, which numbers and starts its flat ops, and its backend,
which reduces them; it never calls back into the gang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from agang._backends.contract import Backend, Done
from agang._backends.fingerprint import describe
from agang._engine import busy
from agang._engine.engine import Engine
from agang._engine.grouping import (
    FlatBuffers,
    Member,
    group_members,
    plan_buckets,
)
from agang._engine.ops import OpEnd
from agang._handle import (
    HELD,
    UNNUMBERED,
    Coalesced,
    Handle,
    add_flat,
    add_held,
    failed_handle,
    finish_all,
    group_timeout,
    hold,
    seal,
)
from agang._reduce_op import ReduceOp
from agang._runtime import loops
from agang._runtime.future import add_done_callback, finish

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass(eq=False)
class Scope:
    """One open ``coalesce()`` scope of one owner on one gang."""

    owner: object
    depth: int = 1
    members: list[Member] = field(default_factory=list)
    issued: Coalesced = field(default_factory=Coalesced)

    def take(self) -> list[Member]:
        members, self.members = self.members, []
        return members


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


class Coalescer:
    """The scopes, flat ops and buckets of one gang."""

    def __init__(self, engine: Engine, backend: Backend) -> None:
        self._engine = engine
        self._backend = backend
        #: The open scopes, by owner (task or thread); empty in the common case.
        self.scopes: dict[object, Scope] = {}
        self._buffers = FlatBuffers()

    def clear(self) -> None:
        """Drops the kept flat buffers (the gang closed)."""
        self._buffers.clear()

    # Scopes.

    def scope_of_current_owner(self) -> Scope | None:
        """The open scope of the task (or thread) running now, if any."""
        if not self.scopes:
            return None
        return self.scopes.get(loops.current_owner())

    def flush(self) -> None:
        """Issues what the current owner's scope holds (other ops flush the scope)."""
        if not self.scopes:
            return
        scope = self.scopes.get(loops.current_owner())
        if scope is not None and scope.members:
            self._issue_members(scope.take(), scope.issued)

    @contextlib.contextmanager
    def coalesce(self) -> Iterator[Coalesced]:
        owner = loops.current_owner()
        engine = self._engine
        with engine.lock:
            scope = self.scopes.get(owner)
            if scope is not None:
                scope.depth += 1  # nested scopes join the outermost one
            else:
                engine.check_usable()
                scope = self.scopes[owner] = Scope(owner)
        try:
            yield scope.issued
        finally:
            with engine.lock:
                scope.depth -= 1
                last = scope.depth == 0
                if last:
                    del self.scopes[owner]
            if last:
                # Also on an exception: the held ops were issued as far as the caller
                # and the other ranks know, so they are started, not dropped.
                issued = scope.issued
                self._issue_members(scope.take(), issued)
                seal(issued)

    def hold(
        self, scope: Scope, tensor: torch.Tensor, op: ReduceOp, seconds: float | None
    ) -> Handle[torch.Tensor]:
        """Holds an all-reduce in ``scope`` until it ends; its handle is not numbered yet."""
        engine = self._engine
        if engine.closed or engine.broken is not None:
            engine.check_usable()
        handle: Handle[torch.Tensor] = Handle(
            op="all_reduce",
            seq=UNNUMBERED,
            num_bytes=tensor.nbytes,
            timeout=seconds,
            owner=engine,
        )
        claim = busy.acquire_one("tensor", tensor, handle)
        hold(handle, HELD)
        scope.members.append(Member(tensor, op, tensor.dtype, seconds, handle, claim))
        add_held(scope.issued, handle, tensor)
        return handle

    def _issue_members(self, members: list[Member], issued: Coalesced) -> None:
        for group in group_members(members):
            tensors = [m.tensor for m in group]
            claims = [m.claim for m in group]
            seconds = group_timeout([m.seconds for m in group])
            try:
                flat = self.issue_flat(tensors, group[0].op, seconds, claims)
            except Exception as exc:  # the gang was closed or broke meanwhile
                busy.release_all(claims)
                for member in group:
                    hold(member.handle, None)
                    finish(member.handle, None, exc)
                add_flat(issued, failed_handle("all_reduce", exc))
                continue
            add_flat(issued, flat)
            if len(group) > 1:
                self._engine.count_coalesced(len(group))
            seq = flat.seq
            for member in group:
                handle = member.handle
                handle.seq = seq
                hold(handle, None)
            add_done_callback(flat, _finisher(flat, group))

    # Flat ops.

    def issue_flat(
        self,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        seconds: float | None,
        claims: list[busy.Claim],
    ) -> Handle[list[torch.Tensor]]:
        """One all-reduce over ``tensors``, whose memory ``claims`` hold (flat ops)."""
        engine = self._engine
        num_bytes = sum([t.nbytes for t in tensors])
        handle = engine.new_handle("all_reduce", seconds, num_bytes)
        post: Callable[[], None] | None
        if len(tensors) == 1:
            flat, post = tensors[0], None
        else:
            packed = self._buffers.pack(tensors)
            flat = packed.flat

            def post() -> None:
                self._buffers.unpack(packed, tensors)  # the backend is done with the buffer

        done = OpEnd(engine, handle, tensors, busy.release_all, claims)
        start_all_reduce = self._backend.start_all_reduce

        def start(done: Done) -> None:
            start_all_reduce(flat, op, done, post)

        engine.admit(
            handle, start, done, fingerprint=lambda: f"all_reduce({op.name}, {describe(flat)})"
        )
        return handle

    def all_reduce_bucketed(
        self,
        tensors: list[torch.Tensor],
        op: ReduceOp,
        bucket_bytes: int,
        seconds: float | None,
    ) -> list[Handle[list[torch.Tensor]]]:
        """Issues ``tensors`` (checked) as capped flat buckets; a handle per bucket."""
        self._engine.check_usable()
        self.flush()
        keys = [((t.dtype, t.device), t.numel() * t.element_size()) for t in tensors]
        buckets = plan_buckets(keys, bucket_bytes)
        # Every bucket's memory is claimed before any is issued: a busy tensor refuses
        # the whole call, and nothing is issued (a bad call changes nothing).
        claims: list[busy.Claim] = []
        try:
            for number, bucket in enumerate(buckets):
                holder = _BucketHolder(number)
                pairs = [(f"tensors[{i}]", tensors[i]) for i in bucket]
                claims.append(busy.acquire(pairs, holder))
        except Exception:
            busy.release_all(claims)
            raise
        handles = []
        for number, bucket in enumerate(buckets):
            members = [tensors[i] for i in bucket]
            try:
                handles.append(self.issue_flat(members, op, seconds, [claims[number]]))
            except Exception as exc:  # the gang broke or closed meanwhile
                busy.release_all(claims[number:])
                handles.append(failed_handle("all_reduce", exc))
                break
        self._engine.count_coalesced(sum(len(b) for b in buckets if len(b) > 1))
        return handles
