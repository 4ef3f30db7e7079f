"""A sharded server's round, on its rank 0: each bucket received from the publisher
into a small ring of buffers, this rank's shares copied into its staging, and the other
ranks' shares sent to them over a lane of the server's gang.

Rules:
1. *One member.* Rank 0 of the server's gang is the channel's member (the publisher sees
   one subscriber); the other ranks (``agang._weights.relayed``) take their shares from
   it over the gang's relay lane (``weights:CHANNEL#N``, ``agang._weights.over_gang``
   rule 3), in the order both sides derive from the plan (``server_shares``).
2. *The lane's words.* Each ``DATA`` round starts with a control word sent to each rank
   on the lane (``DATA``, the version, the epoch); rank 0 then sends each rank its
   shares of each bucket in plan order, and each rank acknowledges the whole version
   (its number, sent to rank 0). Rank 0 then ends the round with ``COMMIT`` to each
   rank, and confirms the version to the publisher, and says it is ready, only once
   every rank acknowledged it: all or nothing per version. A round that stops part way
   (the publisher moved on, the epoch's gang failed: a fleet's hiccup) still ends on the
   lane: rank 0 sends zeros for the shares that never came, takes the acknowledgements
   and says ``ABORT``, so the ranks stay in step and hold no version of it; a rank marks
   a version ready only on ``COMMIT``.
3. *Bounded memory.* Bucket 0 is the service's own buffer; the others take turns in a
   ring of ``RING`` buffers of one bucket each: bucket ``i``'s receive is posted once
   the shares of the bucket before in its buffer were sent on. A share strided in the
   bucket (``Shard(d)``, ``d >= 1``) is packed through a scratch buffer of one bucket
   first. So rank 0 holds its slice's staging, bucket 0, ``RING`` buckets and (for
   ``Shard(d >= 1)``) one more; the other ranks hold their slice's staging.
4. *Whole tensors* (``Replicate()``, plain) are sent to every rank whole; a
   ``Shard(d)`` tensor's rows or columns to the rank that holds them
   (``agang._weights.sharding`` rule 3).
5. *A rank lost.* An op of the lane that fails breaks the relay (``broken`` says why,
   naming the rank) and closes the lane, so that every other rank's
   wait ends too; the service then gives up the whole server for that round
   (``agang._weights.service`` rule 7). A rank that is alive takes its shares as soon
   as rank 0 has them (its rounds run on a thread of their own, and wait at most for
   a copy into the application's tensors, which runs while rank 0 makes its own: the
   ranks copy together, once every one voted yes), so each op of the lane is bounded by
   ``RELAY_SECONDS`` plus that op's own bytes at ``RELAY_BYTES_PER_SECOND`` (``bound``),
   never by the version's: a rank lost or stopped is named within seconds whatever the
   model's size, well within the publisher's deadline of a push, where a transport
   that does not see a closed connection (a stopped process) says nothing.
6. *The end.* Rank 0's service ending closes the lane; before it does, it tells each
   rank why in a ``CLOSE`` word and the reason's text (the word: ``CLOSE``, the text's
   bytes, 1 where the publisher closed the channel, a normal end, else 0), so that a
   rank's ``receive`` raises what rank 0's raises; where the relay broke, the lane is
   closed already, and the ranks name the lost one themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from agang._errors import GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._runtime.threads import start_daemon
from agang._weights.buckets import copy_views
from agang._weights.plan import Plan
from agang._weights.sharding import Layout

#: The lane's control words (rule 2): (what, version, epoch); ``CLOSE``: rank 0's
#: service ended (rule 6: CLOSE, the reason's bytes, 1 for a normal end);
#: ``COMMIT`` or ``ABORT``: a round's end.
DATA = 1
CLOSE = 2
COMMIT = 3
ABORT = 4
CONTROL_WORDS = 3
#: Buffers the buckets after bucket 0 take turns in (rule 3).
RING = 2
#: The bound of each op of the relay lane (rule 5): this, plus the op's bytes at
#: ``RELAY_BYTES_PER_SECOND``, at most the subscriber's timeout.
RELAY_SECONDS = 2.0
RELAY_BYTES_PER_SECOND = 100e6


def bound(nbytes: int, timeout: float) -> float:
    """The bound of an op of the lane that moves ``nbytes`` (rule 5)."""
    return min(timeout, RELAY_SECONDS + nbytes / RELAY_BYTES_PER_SECOND)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: A bucket's own copies (into staging, from the bucket), and its sends (rank, what is
#: sent, the strided place packed into it first, or None).
Cut = tuple[
    list[tuple[torch.Tensor, torch.Tensor]], list[tuple[int, torch.Tensor, torch.Tensor | None]]
]
#: A share of a bucket: (rank, its place in the bucket, where that rank is ``me`` its
#: place in ``me``'s staging, else None).
Share = tuple[int, torch.Tensor, torch.Tensor | None]


def server_shares(
    plan: Plan, layouts: list[Layout], index: int, bucket: torch.Tensor, me: int, size: int
) -> list[Share]:
    """Who of a gang of ``size`` takes what of bucket ``index`` (rules 1, 4), in the
    order both sides of the lane take them: per part of the bucket, per rank."""
    out: list[Share] = []
    for tensor, offset, nbytes, start in plan.buckets()[index][2]:
        layout = layouts[tensor]
        row = plan.row_bytes(tensor)
        rows = (start // row, (start + nbytes) // row)
        part = layout.rows_of(bucket[offset : offset + nbytes], rows)
        for rank in range(size):
            share = layout.share(rank, rows)
            if share is not None:
                dim, at, length, local_at, local_length = share
                local = layout.local_rows(local_at, local_length) if rank == me else None
                out.append((rank, part.narrow(dim, at, length), local))
    return out


class Relay:
    """Rank 0's rounds of a sharded server (module rules), into the staging tensors that
    ``layouts`` hold, the others' shares sent over ``lane``."""

    def __init__(self, plan: Plan, layouts: list[Layout], lane: Gang, size: int) -> None:
        self.plan = plan
        self._layouts = layouts
        self._lane = lane
        self._size = size
        self._peers = range(1, size)
        self.device = layouts[0].local.device
        self._sizes = [nbytes for _, nbytes, _ in plan.buckets()]
        ring = max(self._sizes[1:], default=0)
        self._ring = [self._zeros(ring) for _ in range(min(RING, len(self._sizes) - 1))]
        self._scratch: torch.Tensor | None = None  # made where a share is strided
        self._plans = [self._cut(index, self.wire(index)) for index in range(1, self.count)]
        #: Why the relay is broken (rule 5), or None.
        self.broken: str | None = None

    def _zeros(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    @property
    def first_bytes(self) -> int:
        """Bucket 0's bytes (the service's buffer)."""
        return self._sizes[0]

    @property
    def count(self) -> int:
        return len(self._sizes)

    @property
    def allocated_bytes(self) -> int:
        """The bytes of the ring and the scratch (rule 3)."""
        scratch = 0 if self._scratch is None else self._scratch.numel()
        return sum(r.numel() for r in self._ring) + scratch

    def wire(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s buffer in the ring (``index >= 1``)."""
        return self._ring[(index - 1) % len(self._ring)][: self._sizes[index]]

    def _cut(self, index: int, wire: torch.Tensor) -> Cut:
        """Bucket ``index``'s own copies (into staging, from the bucket), and its sends
        (rank, what is sent, the strided place packed into it first, or None)."""
        own: list[tuple[torch.Tensor, torch.Tensor]] = []
        sends: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        used = 0
        for rank, place, local in server_shares(
            self.plan, self._layouts, index, wire, 0, self._size
        ):
            if local is not None:
                own.append((local, place))
            elif place.is_contiguous():
                sends.append((rank, place, None))
            else:
                if self._scratch is None:
                    self._scratch = self._zeros(max(self._sizes))
                size = place.numel() * place.element_size()
                packed = self._scratch[used : used + size].view(place.dtype).view(place.shape)
                used += size
                sends.append((rank, packed, place))
        return own, sends

    def renew_held(self, holds: list[Gang]) -> None:
        """New ring buffers for those an op of a failed epoch still holds
        (``agang._weights.buckets`` rule 6)."""
        renewed = False
        for slot, buffer in enumerate(self._ring):
            if any(gang.holds(buffer) for gang in holds):
                self._ring[slot] = self._zeros(buffer.numel())
                renewed = True
        if renewed:
            self._plans = [self._cut(index, self.wire(index)) for index in range(1, self.count)]

    async def round(
        self,
        gang: Gang,
        bucket0: torch.Tensor,
        version: int,
        epoch: int,
        watch: Callable[[list[Any]], Awaitable[str | None]],
        timeout: float,  # noqa: ASYNC109
    ) -> str | None:
        """The ``DATA`` round of ``version`` past bucket 0 (in ``bucket0``) on the
        epoch's ``gang`` (rules 2, 3); why it stopped where ``watch`` said the publisher
        moved on, else None once every rank acknowledged the version. Raises
        ``GangError``: the epoch's gang failed, or (``broken`` set) the relay did."""
        self._check()
        word = bound(CONTROL_WORDS * 8, timeout)  # a control word's op (rule 5)
        await self._tell([DATA, version, epoch], word)
        posted: dict[int, Handle[torch.Tensor]] = {}
        for index in range(1, min(1 + len(self._ring), self.count)):
            posted[index] = gang.broadcast(self.wire(index), 0, timeout=timeout)
        await self._pass_on(self._cut(0, bucket0), timeout)
        moved: str | None = None
        failure: GangError | None = None
        index = 1
        while index < self.count:
            try:
                moved = await watch([posted.pop(index)])
            except GangError as error:  # the epoch's gang's, unless the relay broke
                if self.broken is not None:
                    raise
                failure = error
            if moved is not None or failure is not None:
                break
            await self._pass_on(self._plans[index - 1], timeout)
            after = index + len(self._ring)
            if after < self.count:  # its ring buffer is free: its shares went on
                posted[after] = gang.broadcast(self.wire(after), 0, timeout=timeout)
            index += 1
        for rest in range(index, self.count):  # an interrupted round ends too (rule 2)
            await self._pass_on_nothing(self._plans[rest - 1], timeout)
        acks = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self._size)]
        acked = [(rank, self._lane.recv(acks[rank], rank, timeout=word)) for rank in self._peers]
        for rank, ack in acked:
            await self._op(ack, rank)
            if int(acks[rank][0]) != version:
                self._break(
                    f"server rank {rank} acknowledged version {int(acks[rank][0])}, not {version}"
                )
                raise GangError(self.broken or "")
        whole = moved is None and failure is None
        await self._tell([COMMIT if whole else ABORT, version, epoch], word)
        if failure is not None:
            raise failure
        return moved

    async def _tell(self, said: list[int], timeout: float) -> None:  # noqa: ASYNC109
        """Sends the control word ``said`` to every other rank (rule 2), a tensor per
        rank: an op may not read another's."""
        told = [
            (r, self._lane.send(torch.tensor(said, dtype=torch.int64, device=self.device), r,
                                timeout=timeout))
            for r in self._peers
        ]  # fmt: skip
        for rank, handle in told:
            await self._op(handle, rank)

    async def _pass_on_nothing(self, cut: Cut, timeout: float) -> None:  # noqa: ASYNC109
        """An interrupted round's bucket: zeros of each share's shape in place of its
        bytes, which never came (rule 2): the others' receives end, and the round's
        ``ABORT`` tells them it is not a version. Each op bounded by its bytes (rule 5)."""
        _, sends = cut
        told = [
            (rank, self._lane.send(torch.zeros_like(what), rank,
                                   timeout=bound(_nbytes(what), timeout)))
            for rank, what, _ in sends
        ]  # fmt: skip
        for rank, handle in told:
            await self._op(handle, rank)

    async def _pass_on(self, cut: Cut, timeout: float) -> None:  # noqa: ASYNC109
        """Copies a bucket's own shares into staging and sends the others theirs; returns
        once they were sent (rule 3). A part every rank takes (a whole tensor's) goes to
        one rank at a time: an op may not read memory another op still holds. Each op
        is bounded by its own bytes (rule 5)."""
        own, sends = cut
        for into, came in own:
            copy_views(into, came)
        flying: dict[tuple[int, int], tuple[int, Handle[None]]] = {}
        for rank, what, place in sends:
            if place is not None:
                copy_views(what, place)
            key = (what.data_ptr(), what.numel())
            if key in flying:
                before, sending = flying.pop(key)
                await self._op(sending, before)
            sending = self._lane.send(what, rank, timeout=bound(_nbytes(what), timeout))
            flying[key] = (rank, sending)
        for rank, handle in flying.values():
            await self._op(handle, rank)

    async def _op(self, handle: Handle[Any], rank: int) -> Any:
        """Awaits an op of the lane with ``rank``; one that fails breaks the relay (rule 5)."""
        try:
            return await handle
        except GangError as error:
            self._break(f"server rank {rank} was lost: {one_line(error)}")
            raise

    def _check(self) -> None:
        if self.broken is not None:
            raise GangError(self.broken)

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        start_daemon(self._lane.close_sync, name="agang: weights: close the relay lane")

    def close(self, why: str, closed: bool) -> None:
        """Closes the lane: the other ranks' waits for a round end; they are told ``why``
        first (rule 6), where the relay did not break: ``closed`` where the publisher
        closed the channel (a normal end, not a loss). Called off any loop, on the
        service's thread as it ends."""
        if self.broken is None:
            text = list(why.encode())
            parts = [([CLOSE, len(text), 1 if closed else 0], torch.int64)]
            parts += [(text, torch.uint8)] if text else []
            told = [  # a tensor per op: an op may not read another's
                self._lane.send(torch.tensor(part, dtype=kind, device=self.device), rank,
                                timeout=1.0)
                for rank in self._peers
                for part, kind in parts
            ]  # fmt: skip
            for handle in told:
                with contextlib.suppress(Exception):  # a rank gone: its waits end anyway
                    handle.wait(2.0)
        self._lane.close_sync()
