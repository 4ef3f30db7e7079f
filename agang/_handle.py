"""What a gang's call returns: a handle, issued already, complete when awaited.

A handle is one op as the user issued it: an all-reduce, a broadcast, a whole
``all_reduce_bucketed`` call. It is a ``agang._runtime.future.Future`` (finished once, by
any thread; waiting never changes the op) with the op's metadata, and it tells the
engine that issued it (its *owner*) when a waiter starts and when one resumes.

Every result type a call returns lives here: [`Handle`][agang.Handle];
[`Coalesced`][agang.Coalesced], what a ``coalesce()`` scope issued; ``all_of``, one handle
over several backend ops (a bucketed all-reduce, a scope); ``failed_handle``, for an op
that could not be issued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterable, Sequence
from typing import Any, Protocol, TypeVar, final

import torch

from agang._policy import GangPolicy
from agang._runtime import brief_wait
from agang._runtime.future import (
    _DONE,
    READY_STREAK,
    Future,
    _parked,
    add_done_callback,
    finish,
    finish_at,
    pending,
    wait_async,
)
from agang._validate import check_timeout

T = TypeVar("T")

#: ``Handle.seq`` of an op that has no number on its gang: held in an open
#: ``coalesce()`` scope (numbered when the scope ends), or never issued.
UNNUMBERED = -1


class HandleOwner(Protocol):
    """What issued a handle, told about its waiters (the engine)."""

    #: The gang's policy; its ``wait_mode`` decides how an ``await`` waits.
    policy: GangPolicy

    #: Whether a waiter learns of the op's end by asking (``settle``, ``park_for``).
    polls: bool

    def waiting(self) -> None:
        """A waiter starts on one of its pending ops (a lost deadline check is re-armed)."""

    def learn(self, handle: Handle[Any]) -> None:
        """Asks the backend once, on this thread, whether ``handle``'s op ended."""

    async def settle(self, handle: Handle[Any]) -> None:
        """Learns of ``handle``'s end on the awaiting task's loop, within a budget, once
        ``learn`` found the op running."""

    def park_for(self, handle: Handle[Any]) -> None:
        """A plain thread is about to block on ``handle``: have its end reported."""

    def resumed(self, lag: float) -> None:
        """A waiter resumed ``lag`` seconds after its op finished (the loop's lag)."""


@final
class Handle(Future[T]):
    """An issued collective. ``await`` it (or call [`wait`][agang.Handle.wait]) for its output.

    The op was handed to the backend when the gang's method returned this handle, so
    work placed between the call and the ``await`` overlaps the communication.

    Example:
        ```python
        import asyncio

        import torch

        from agang.testing import FakeWorld


        async def step(gang):
            grad = torch.ones(2)
            handle = gang.all_reduce(grad)  # issued: it runs while this rank goes on
            other = sum(range(1000))  # other work here overlaps the communication
            grad = await handle
            return grad.tolist(), other


        assert asyncio.run(FakeWorld(2).run(step))[0] == ([2.0, 2.0], 499500)
        ```
    """

    __slots__ = ("_collective", "_hold", "_owner", "issued_at", "num_bytes", "op", "seq", "timeout")

    def __init__(
        self,
        *,
        op: str,
        seq: int,
        num_bytes: int,
        timeout: float | None,
        owner: HandleOwner | None = None,
    ) -> None:
        super().__init__(op)
        self._set_up(op, seq, num_bytes, timeout, owner)

    def _set_up(
        self,
        op: str,
        seq: int,
        num_bytes: int,
        timeout: float | None,
        owner: HandleOwner | None,
        collective: int = -1,
    ) -> None:
        # The handle's own state; the future's is the future's to set (``__init__``, or
        # ``pending`` on the engine's path: ``issued``).
        #: The collective's name, e.g. ``"all_reduce"``.
        self.op = op
        #: This op's sequence number on its gang, in call order: equal on every rank for
        #: the same op where every op before it involved every rank (point-to-point ops
        #: among some ranks advance only theirs).
        self.seq = seq
        # Its number among the gang's collectives (-1: a point-to-point op), equal on every
        # rank: what a peer's blame asks about (``agang._engine.scheduler``'s rule 6).
        self._collective = collective
        #: Bytes this rank sends or receives (the size of its tensors).
        self.num_bytes = num_bytes
        #: The deadline in seconds from ``issued_at``, or None for none.
        self.timeout = timeout
        #: ``time.monotonic()`` when the op was issued.
        self.issued_at = time.monotonic()
        # Why waiting now would never end (the op is held in an open coalesce scope).
        self._hold: str | None = None
        self._owner = owner

    def __str__(self) -> str:
        if self.seq == UNNUMBERED:
            return f"`{self.op}` (not numbered)"
        return f"`{self.op}` (seq {self.seq})"

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<agang.Handle {self.op} seq={self.seq} bytes={self.num_bytes} {state}>"

    @property
    def elapsed(self) -> float | None:
        """Seconds from issue to finish, or None while pending."""
        if self._finished_at is None:
            return None
        return self._finished_at - self.issued_at

    def __await__(self) -> Generator[Any, None, T]:
        # The usual await of an op that ended already (learned at a later issue, or
        # ended inside its call): its output, with no coroutine made and, within the
        # ready streak (``agang._runtime.future.READY_STREAK``), no pass of the loop.
        owner = self._owner
        if self._state != _DONE and owner is not None and owner.polls:
            owner.learn(self)  # one poll on this thread: most ops end soon
        if self._state == _DONE:
            parked = _parked
            if parked.ready < READY_STREAK and (
                owner is None or owner.policy.wait_mode != "block_briefly"
            ):
                parked.ready += 1
                return self.result()
        return (yield from self._wait_async().__await__())

    async def _wait_async(self) -> T:
        self._check_not_held()
        owner = self._owner
        if owner is None:
            await wait_async(self)
            return self.result()
        brief = owner.policy.wait_mode == "block_briefly"
        if not self.done():
            owner.waiting()
            if owner.polls:
                await owner.settle(self)
            elif brief:
                # Only timing changes: a finished handle takes the path below that an
                # already finished one takes (``agang._runtime.brief_wait``, rule 4).
                brief_wait.block_briefly(self, self.num_bytes, self.issued_at)
        if await wait_async(self) and self._finished_at is not None:
            owner.resumed(time.monotonic() - self._finished_at)
        if brief and self._finished_at is not None:
            brief_wait.record(self.num_bytes, self._finished_at - self.issued_at)
        return self.result()

    def wait(self, timeout: float | None = None) -> T:
        """Blocks the calling thread until the op finishes, and returns its output.

        For synchronous code. On an event loop's thread, ``await`` the handle instead:
        this call would stop the loop (and a deadline the loop drives) while it waits.

        Args:
            timeout: Seconds to wait at most, or None. This bounds the *wait*, not the
                op: when it passes the op keeps running and its tensors stay busy.

        Returns:
            The op's output, as ``await`` would return it.

        Raises:
            TimeoutError: ``timeout`` passed before the op finished.
            GangError: The op failed; see ``result``.

        Example:
            <!-- not-run: wait() blocks: for a gang of init_sync, in a launched world -->
            ```python
            out = gang.all_reduce(t).wait()
            ```
        """
        seconds = check_timeout(timeout)
        self._check_not_held()
        if not self.done():
            owner = self._owner
            if owner is not None:
                owner.waiting()
                if owner.polls:
                    owner.park_for(self)
            self._block(seconds)
        return self.result()

    def _check_not_held(self) -> None:
        hold = self._hold
        if hold is not None and not self.done():
            raise RuntimeError(hold)


def collective_of(handle: Handle[Any]) -> int:
    """``handle``'s number among its gang's collectives (-1: a point-to-point op), equal
    on every rank: what the engine records, and a peer's blame asks about."""
    return handle._collective


def hold(handle: Handle[Any], why: str | None) -> None:
    """While ``handle`` is not done, waiting on it raises ``RuntimeError(why)`` (a
    ``coalesce()`` scope holds its op); None lets waiting go ahead again."""
    handle._hold = why


def issued(
    op: str,
    seq: int,
    num_bytes: int,
    timeout: float | None,
    owner: HandleOwner | None,
    collective: int,
) -> Handle[Any]:
    """``Handle(op=op, seq=seq, ...)`` for the engine, which makes one per op: the same
    handle, without the keyword call (half the cost of making one), with its number among
    the gang's collectives."""
    handle: Handle[Any] = pending(Handle, op)
    handle._set_up(op, seq, num_bytes, timeout, owner, collective)
    return handle


def finish_all(outcomes: Iterable[tuple[Handle[Any], Any]], error: BaseException | None) -> None:
    """Finishes many handles (a flat op's members) with one timestamp."""
    now = time.monotonic()
    for handle, value in outcomes:
        finish_at(handle, value, error, now)


def failed_handle(op: str, error: BaseException) -> Handle[Any]:
    """The handle of an op that could not be issued: failed already, never numbered."""
    handle: Handle[Any] = Handle(op=op, seq=UNNUMBERED, num_bytes=0, timeout=None)
    finish(handle, None, error)
    return handle


def all_of(handles: Sequence[Handle[Any]], value: Any, *, op: str) -> Handle[Any]:
    """One user op made of several backend ops: a handle that finishes with ``value``
    once all ``handles`` have, or with the first error among them (in order)."""
    combined: Handle[Any] = Handle(
        op=op,
        seq=handles[0].seq if handles else UNNUMBERED,
        num_bytes=sum(h.num_bytes for h in handles),
        timeout=group_timeout([h.timeout for h in handles]),
        owner=handles[0]._owner if handles else None,
    )
    if not handles:
        finish(combined, value, None)
        return combined
    lock = threading.Lock()
    remaining = [len(handles)]

    def one_done() -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [h.exception() for h in handles if h.exception() is not None]
        finish(combined, None if errors else value, errors[0] if errors else None)

    for handle in handles:
        add_done_callback(handle, one_done)
    return combined


def group_timeout(timeouts: Sequence[float | None]) -> float | None:
    """The tightest deadline of a group's members; None when none has one."""
    finite = [t for t in timeouts if t is not None]
    return min(finite) if finite else None


HELD = (
    "This all_reduce is held by the open `coalesce()` scope that issued it and starts "
    "when the scope ends; await it after the `with` block."
)


@final
class Coalesced:
    """What a ``coalesce()`` scope issued: await it for all its tensors at once.

    Each held all-reduce also has its own handle ([`handles`][agang.Coalesced.handles]); awaiting
    this object instead costs one wake-up for the whole scope.

    Example:
        ```python
        import asyncio

        import torch

        from agang.testing import FakeWorld


        async def step(gang):
            grads = [torch.ones(2), torch.ones(3)]
            with gang.coalesce() as batch:
                for grad in grads:
                    gang.all_reduce(grad)
            await batch  # every grad reduced, in place
            return [grad[0].item() for grad in grads]


        assert asyncio.run(FakeWorld(2).run(step)) == [[2.0, 2.0]] * 2
        ```
    """

    def __init__(self) -> None:
        #: The handles of the scope's all-reduces, in call order.
        self.handles: list[Handle[torch.Tensor]] = []
        self._tensors: list[torch.Tensor] = []
        self._flats: list[Handle[list[torch.Tensor]]] = []  # the flat ops, as issued
        self._all: Handle[list[torch.Tensor]] | None = None

    def _issued(self) -> Handle[list[torch.Tensor]]:
        if self._all is None:
            raise RuntimeError(HELD)
        return self._all

    def __await__(self) -> Generator[Any, None, list[torch.Tensor]]:
        return self._issued().__await__()

    def wait(self, timeout: float | None = None) -> list[torch.Tensor]:
        """Blocks until every all-reduce of the scope finished; their tensors."""
        return self._issued().wait(timeout)


# What a ``coalesce()`` scope's coalescer writes into its ``Coalesced`` (module functions,
# not methods, so that they stay off the public class).


def add_held(issued: Coalesced, handle: Handle[torch.Tensor], tensor: torch.Tensor) -> None:
    """The scope holds one more all-reduce: ``handle``, over ``tensor``."""
    issued.handles.append(handle)
    issued._tensors.append(tensor)


def add_flat(issued: Coalesced, flat: Handle[list[torch.Tensor]]) -> None:
    """One flat op of the scope was issued (or failed to be: a failed handle)."""
    issued._flats.append(flat)


def seal(issued: Coalesced) -> None:
    """The scope ended and its flat ops were issued: awaiting ``issued`` now waits for
    them all, and gives the scope's tensors."""
    issued._all = all_of(issued._flats, issued._tensors, op="coalesce")
