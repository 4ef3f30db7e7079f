"""n ranks in one event loop, with the real semantics of collectives.

Rules:
1. Each member of a communicator counts its collectives; the k-th collective of every
   member meets the k-th of the others (as in c10d). When the last one arrives the op is
   computed from all inputs and every member's op completes.
2. Members that disagree (another op, root, reduce op, dtype or shape) all fail with a
   ``GangError`` naming each rank's side, where real c10d would hang or corrupt data.
3. Point-to-point ops match per (source, destination) pair in FIFO order, apart from the
   collectives' count, as in c10d.
4. Completions are never run inline on the issuing call: they are scheduled on the loop
   (asyncio ``call_soon``, trio ``run_sync_soon``) or, with ``latency``, after that many
   seconds. So awaiting, cancellation and deadlines behave as with a real backend.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, final

import anyio
import torch
from typing_extensions import override

from agang import _deadline
from agang._base_gang import BaseGang
from agang._errors import GangError
from agang._gang import Gang
from agang._issuing import Checked, Done, after_post
from agang._policy import GangPolicy, InFlightLimits, OnTimeout, make_policy
from agang._reduce_op import ReduceOp
from agang._validate import check_member_ranks, check_positive_int, check_timeout

T = TypeVar("T")


def reduce_tensors(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """The reduction of ``tensors`` by ``op``, in rank order, without type promotion."""
    result = tensors[0].clone()
    for tensor in tensors[1:]:
        if result.dtype == torch.bool:
            if op in (ReduceOp.SUM, ReduceOp.MAX):
                result.logical_or_(tensor)
            else:
                result.logical_and_(tensor)
        elif op in (ReduceOp.SUM, ReduceOp.MEAN):
            result.add_(tensor)
        elif op is ReduceOp.PRODUCT:
            result.mul_(tensor)
        elif op is ReduceOp.MIN:
            torch.minimum(result, tensor, out=result)
        else:
            torch.maximum(result, tensor, out=result)
    if op is ReduceOp.MEAN:
        result.div_(len(tensors))
    return result


@dataclass
class _Arrival:
    rank: int
    kind: str
    key: tuple[Any, ...]  # what every member must agree on
    args: tuple[Any, ...]
    done: Done


@dataclass
class _Communicator:
    world: FakeWorld
    size: int
    meetings: dict[int, dict[int, _Arrival]] = field(default_factory=dict)
    checks: dict[int, dict[int, tuple[str, Checked]]] = field(default_factory=dict)
    # The ranks that posted each unsettled check's fingerprint, withdrawn ones included.
    reached: dict[int, set[int]] = field(default_factory=dict)
    channels: dict[tuple[int, int], deque[tuple[str, torch.Tensor, Done]]] = field(
        default_factory=dict
    )

    def arrive(self, index: int, arrival: _Arrival) -> None:
        with self.world._lock:
            meeting = self.meetings.setdefault(index, {})
            meeting[arrival.rank] = arrival
            if len(meeting) < self.size:
                return
            del self.meetings[index]
        self._settle([meeting[r] for r in range(self.size)])

    def _settle(self, arrivals: list[_Arrival]) -> None:
        first = arrivals[0]
        if any((a.kind, a.key) != (first.kind, first.key) for a in arrivals):
            sides = "; ".join(f"rank {a.rank}: {a.kind} {a.key}" for a in arrivals)
            error = GangError(f"The ranks issued different collectives at one position: {sides}")
            self._finish_all(arrivals, error)
            return
        try:
            _COMPUTE[first.kind](arrivals)
        except Exception as exc:
            self._finish_all(arrivals, exc)
            return
        self._finish_all(arrivals, None)

    def check(self, index: int, rank: int, fingerprint: str, checked: Checked) -> None:
        """Order checking: the ``index``-th fingerprints of every member meet here."""
        with self.world._lock:
            meeting = self.checks.setdefault(index, {})
            meeting[rank] = (fingerprint, checked)
            self.reached.setdefault(index, set()).add(rank)
            if len(meeting) < self.size:
                return
            del self.checks[index]
            del self.reached[index]
        fingerprints = {r: fp for r, (fp, _) in meeting.items()}
        agree = len(set(fingerprints.values())) == 1
        for _, report in meeting.values():
            self.world._schedule(functools.partial(report, None if agree else fingerprints, None))

    def absent_from_check(self, index: int) -> list[int]:
        """The ranks that never posted the ``index``-th fingerprint (one that posted it
        and then withdrew, its gang broken, did reach the check)."""
        with self.world._lock:
            reached = self.reached.get(index, set())
            return [rank for rank in range(self.size) if rank not in reached]

    def withdraw(self, rank: int) -> list[Done]:
        """Takes back ``rank``'s ops that no peer has met yet; returns their ``done``."""
        with self.world._lock:
            dones = [
                meeting.pop(rank).done for meeting in self.meetings.values() if rank in meeting
            ]
            for meeting in self.checks.values():
                if rank in meeting:
                    report = meeting.pop(rank)[1]
                    dones.append(functools.partial(report, None))
            for (source, destination), queue in list(self.channels.items()):
                mine = "send" if source == rank else "recv" if destination == rank else None
                dones += [done for kind, _, done in queue if kind == mine]
                self.channels[source, destination] = deque(e for e in queue if e[0] != mine)
        return dones

    def _finish_all(self, arrivals: list[_Arrival], error: BaseException | None) -> None:
        for arrival in arrivals:
            self.world._schedule(functools.partial(arrival.done, error))

    def point_to_point(
        self, kind: str, pair: tuple[int, int], tensor: torch.Tensor, done: Done
    ) -> None:
        with self.world._lock:
            queue = self.channels.setdefault(pair, deque())
            if queue and queue[0][0] != kind:
                _, other, other_done = queue.popleft()
            else:
                queue.append((kind, tensor, done))
                return
        sent, received = (tensor, other) if kind == "send" else (other, tensor)
        if sent.shape != received.shape or sent.dtype != received.dtype:
            error = GangError(
                f"send of {tuple(sent.shape)} {sent.dtype} met recv of "
                f"{tuple(received.shape)} {received.dtype} between ranks {pair}"
            )
            self.world._schedule(lambda: done(error))
            self.world._schedule(lambda: other_done(error))
            return
        received.copy_(sent)
        self.world._schedule(lambda: done(None))
        self.world._schedule(lambda: other_done(None))


def _all_reduce(arrivals: list[_Arrival]) -> None:
    op = arrivals[0].key[0]
    result = reduce_tensors([a.args[0] for a in arrivals], op)
    for a in arrivals:
        a.args[0].copy_(result)


def _all_gather(arrivals: list[_Arrival]) -> None:
    inputs = [a.args[1].reshape(-1) for a in arrivals]
    for a in arrivals:
        a.args[0].view(len(arrivals), -1).copy_(torch.stack(inputs))


def _all_gather_to_list(arrivals: list[_Arrival]) -> None:
    inputs = [a.args[1] for a in arrivals]
    for a in arrivals:
        for output, value in zip(a.args[0], inputs, strict=True):
            output.copy_(value)


def _reduce_scatter(arrivals: list[_Arrival]) -> None:
    op = arrivals[0].key[0]
    size = len(arrivals)
    for a in arrivals:
        chunks = [b.args[1].view(size, -1)[a.rank] for b in arrivals]
        a.args[0].view(-1).copy_(reduce_tensors(chunks, op))


def _broadcast(arrivals: list[_Arrival]) -> None:
    source = arrivals[arrivals[0].key[0]].args[0].clone()
    for a in arrivals:
        a.args[0].copy_(source)


def _all_to_all(arrivals: list[_Arrival]) -> None:
    size = len(arrivals)
    inputs = [a.args[1].reshape(size, -1).clone() for a in arrivals]
    for a in arrivals:
        a.args[0].reshape(size, -1).copy_(torch.stack([inputs[j][a.rank] for j in range(size)]))


def _nothing(arrivals: list[_Arrival]) -> None:
    pass


def _create_gang(arrivals: list[_Arrival]) -> None:
    members, lane = arrivals[0].key
    parent = arrivals[0].args[1]
    communicator = _Communicator(parent.world, len(members))
    name = f"{parent.name}/lane:{lane}" if lane else f"{parent.name}{list(members)}"
    for a in arrivals:
        if a.rank in members:
            a.args[0]["gang"] = FakeWorldGang(
                communicator,
                rank=members.index(a.rank),
                name=name,
                policy=parent.policy,
                device=parent.device,
            )


_COMPUTE: dict[str, Callable[[list[_Arrival]], None]] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "all_gather_to_list": _all_gather_to_list,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "all_to_all": _all_to_all,
    "barrier": _nothing,
    "create_gang": _create_gang,
}


def _shapes(*tensors: torch.Tensor) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@final
class FakeWorldGang(BaseGang):
    """One rank of a :class:`FakeWorld`."""

    def __init__(
        self,
        communicator: _Communicator,
        *,
        rank: int,
        name: str,
        policy: GangPolicy,
        device: torch.device,
    ) -> None:
        super().__init__(
            rank=rank,
            size=communicator.size,
            device=device,
            backend="fake",
            name=name,
            policy=policy,
        )
        self.communicator = communicator
        self._collective_index = 0

    @property
    def world(self) -> FakeWorld:
        return self.communicator.world

    def _arrive(self, kind: str, key: tuple[Any, ...], args: tuple[Any, ...], done: Done) -> None:
        index = self._collective_index
        self._collective_index += 1
        self.communicator.arrive(index, _Arrival(self.rank, kind, key, args, done))

    @override
    def _start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        done = after_post(post, done)
        self._arrive("all_reduce", (op, *_shapes(tensor)), (tensor,), done)

    @override
    def _start_all_gather(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        self._arrive("all_gather", _shapes(output, input), (output, input), done)

    @override
    def _start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        self._arrive("all_gather_to_list", _shapes(input), (outputs, input), done)

    @override
    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        self._arrive("reduce_scatter", (op, *_shapes(output, input)), (output, input), done)

    @override
    def _start_broadcast(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        self._arrive("broadcast", (source_rank, *_shapes(tensor)), (tensor,), done)

    @override
    def _start_all_to_all(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        self._arrive("all_to_all", _shapes(output, input), (output, input), done)

    @override
    def _start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        self.communicator.point_to_point("send", (self.rank, destination_rank), tensor, done)

    @override
    def _start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        self.communicator.point_to_point("recv", (source_rank, self.rank), tensor, done)

    @override
    def _start_barrier(self, done: Done) -> None:
        self._arrive("barrier", (), (), done)

    @override
    def _start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        self.communicator.check(index, self.rank, fingerprint, checked)

    @override
    def _start_census(self, index: int, report: Callable[[list[int] | None], None]) -> None:
        report(self.communicator.absent_from_check(index))

    def _withdraw(self, reason: str) -> None:
        # As aborting a real communicator ends its unfinished work: the ops' tensors are
        # released, instead of staying busy (keyed by address) after they are freed.
        error = GangError(
            f"Gang '{self.name}' (rank {self.rank}) was {reason} before its peers came."
        )
        for done in self.communicator.withdraw(self.rank):
            done(error)

    @override
    def _abort_backend(self) -> None:
        self._withdraw("aborted")

    @override
    def _release_backend(self, *, pending: bool) -> None:
        self._withdraw("closed")

    @override
    async def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        members = tuple(check_member_ranks(ranks, self.size))
        gang = await self._make_gang(members, "")
        if gang is not None:
            with self._lock:
                self._children.append(gang)
        return gang

    @override
    async def _create_lane(self, name: str, *, high_priority: bool) -> FakeWorldGang:
        lane = await self._make_gang(tuple(range(self.size)), name)
        assert lane is not None  # every rank is a member
        return lane

    async def _make_gang(self, members: tuple[int, ...], lane: str) -> FakeWorldGang | None:
        slot: dict[str, FakeWorldGang | None] = {"gang": None}
        handle = self._issue(
            "create_gang",
            [],
            slot,
            None,
            lambda done: self._arrive("create_gang", (members, lane), (slot, self), done),
            fingerprint=f"create_gang({list(members)}, lane={lane!r})",
        )
        await handle
        return slot["gang"]


@final
class FakeWorld:
    """``size`` ranks in one process and one event loop, for users' tests.

    Collectives meet across the ranks and compute real results (unlike
    :class:`agang.FakeGang`, which assumes every rank holds the same data). Ops complete
    on the loop, after ``latency`` seconds if given; deadlines, cancellation and busy
    tensors behave as on a real backend.

    Args:
        size: The number of ranks.
        device: Where tensors must live.
        op_timeout: The gangs' default deadline in seconds, or None for none.
        latency: Seconds each op takes to complete once every rank has issued it.
        on_timeout: ``"abort"`` (a timeout breaks the gang) or ``"raise"`` (only that op
            fails).
        limits: The in-flight bounds (:class:`agang.InFlightLimits`); None for defaults.
        check_order: Compare each collective's fingerprint across ranks before starting
            it; None reads ``AGANG_CHECK_ORDER``.

    Example:
        >>> world = FakeWorld(4)
        >>> async def step(gang):
        ...     return (await gang.all_reduce(torch.ones(1))).item()
        >>> await world.run(step)  # [4.0, 4.0, 4.0, 4.0]
    """

    def __init__(
        self,
        size: int,
        *,
        device: torch.device | str = "cpu",
        op_timeout: float | None = 60.0,
        latency: float = 0.0,
        on_timeout: OnTimeout = "abort",
        limits: InFlightLimits | None = None,
        check_order: bool | None = False,
    ) -> None:
        check_positive_int(size, name="size")
        self.latency = check_timeout(latency, name="latency") or 0.0
        self._lock = threading.RLock()
        communicator = _Communicator(self, size)
        policy = make_policy(
            op_timeout=op_timeout, on_timeout=on_timeout, limits=limits, check_order=check_order
        )
        self.gangs: list[FakeWorldGang] = [
            FakeWorldGang(
                communicator,
                rank=rank,
                name="fake-world",
                policy=policy,
                device=torch.device(device),
            )
            for rank in range(size)
        ]

    @property
    def size(self) -> int:
        return len(self.gangs)

    def __getitem__(self, rank: int) -> FakeWorldGang:
        return self.gangs[rank]

    def __len__(self) -> int:
        return len(self.gangs)

    async def run(self, fn: Callable[[Gang], Awaitable[T]]) -> list[T]:
        """Runs ``fn(gang)`` for every rank concurrently; returns the results by rank."""
        results: list[Any] = [None] * self.size

        async def one(rank: int) -> None:
            results[rank] = await fn(self.gangs[rank])

        async with anyio.create_task_group() as group:
            for rank in range(self.size):
                group.start_soon(one, rank)
        return results

    def _schedule(self, callback: Callable[[], None]) -> None:
        if self.latency:
            driver = _deadline.current_driver()
            _deadline.call_at(driver, time.monotonic() + self.latency, callback)
            return
        loop = asyncio._get_running_loop()
        if loop is not None:
            loop.call_soon(callback)
            return
        try:
            import trio

            trio.lowlevel.current_trio_token().run_sync_soon(callback)
        except (ImportError, RuntimeError):
            callback()  # no loop here: synchronous callers see it done at once
