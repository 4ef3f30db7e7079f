"""A trainer gang's push, on its rank 0: each bucket gathered from the ranks' shards
into a small ring of buffers while the one before moves to the fleet.

Rules:
1. *One sender.* Rank 0 of the trainer's gang is the channel's publisher; the other
   ranks (``agang._weights.following``) send it their shares of each bucket over a lane
   of the gang (``weights:CHANNEL``: its own order, so the push never interleaves with
   the trainer's other collectives). A push is a collective over the gang.
2. *The lane's words.* Every push, on the lane: rank 0 sends each rank a control word
   per round (``ROUND`` and the version: a recovery runs the round again, and the shards
   are read again, since no rank keeps the model whole), each rank sends its shares of
   each bucket in plan order, and the push ends with ``DONE`` and the push's outcome
   (the report, or why it failed, as JSON) sent from rank 0, so that every rank
   returns the same report or raises the same error. Every word is ``WORD_BYTES``
   long: an outcome that fits rides in its ``DONE`` word (one op, one wake-up of each
   rank), a longer one follows it, the word saying its length. The
   words go point to point, not as broadcasts: their sizes are fixed, or said before,
   so the order check a broadcast of a Gloo gang takes first (a round trip of its own,
   before the round's first word) guards nothing here. Rank 0 sees each word through
   only before it says the next (``settle``), or at ``close``: a push waits for neither
   its first word nor its last.
3. *Bounded memory.* Bucket 0 (at most ``FIRST_BUCKET_BYTES`` past one bucket, with the
   header) has a buffer of its own; the others take turns in a ring of ``RING`` buffers
   of one bucket each, a buffer taken again only once the broadcast of the bucket before
   in it ended; shares that are strided in the bucket (``Shard(d)``, ``d >= 1``) land in
   a scratch buffer of one bucket first, then one strided copy puts them in place. A
   direct bucket that is rows of rank 0's own shard (or of a tensor it holds whole)
   moves from the tensor itself, with no copy. So the sender holds bucket 0, ``RING``
   buckets and (for ``Shard(d >= 1)``) one more, whatever the model's size; the other
   ranks send views of their shards (``agang._weights.sharding`` rule 3) and hold
   nothing more.
4. *A share that does not come* (a rank lost, or late) ends the push on every rank
   with the blame of the lane's op. Late is past the push's deadline, but never sooner
   than ``CANCEL_GRACE`` plus the bucket's time at ``GRACE_BYTES_PER_SECOND``: the
   deadline is the fleet's, and a stalled server that held the round past it is
   dropped by the recovery, not blamed on the trainer ranks. Such a failure: the
   sender stops sending to the fleet and closes the round's gang before any server
   holds the version (``agang._weights.publisher``), and the lane is closed, so the
   other ranks' pushes raise too. A gang that lost a rank is broken: the publisher
   over it is too (its pushes raise, saying why); open one over the gang re-formed.
5. *Cancelled* mid-push, the sender still takes the round's shares (for up to
   ``CANCEL_GRACE`` seconds plus the time they take at ``GRACE_BYTES_PER_SECOND``,
   sending nothing on) and ends the push on the lane, so
   that the lane stays in step and the next push works; past that, the lane is closed
   (rule 4).
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from typing import Any

import anyio
import torch

from agang._errors import GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._runtime.threads import start_daemon
from agang._weights.blocking import bound
from agang._weights.buckets import as_bytes, copy_views
from agang._weights.plan import ALIGN, Plan
from agang._weights.sharding import Layout

#: The lane's control words (rule 2): (what, version or the outcome's length, spare)
#: as int64, then the outcome where it fits, in a word of ``WORD_BYTES``.
ROUND = 1
DONE = 2
CONTROL_WORDS = 3
WORD_BYTES = 1024
INLINE_BYTES = WORD_BYTES - 8 * CONTROL_WORDS
#: Buffers the buckets after bucket 0 take turns in (rule 3).
RING = 2
#: How long a push that ended early keeps the lane in step (rule 5), plus the time the
#: round's shares left take at ``GRACE_BYTES_PER_SECOND``.
CANCEL_GRACE = 1.0
GRACE_BYTES_PER_SECOND = 200e6
#: The bound of the push's last words on the lane (rule 2): the others wait for them.
END_SECONDS = 30.0

#: Per share of a bucket: (rank, its place in the bucket's rows, and where that rank is
#: ``me``, the local rows it is; else None) (``agang._weights.sharding`` rule 3).
Share = tuple[int, torch.Tensor, torch.Tensor | None]


#: A copy of the sender's own share: (into the bucket, from its local tensor).
Copy = tuple[torch.Tensor, torch.Tensor]
#: A share received: (from rank, into, and the strided place in the bucket it is copied
#: to after, where ``into`` is scratch; else None).
Receive = tuple[int, torch.Tensor, torch.Tensor | None]


def shares(
    plan: Plan, layouts: list[Layout], index: int, bucket: torch.Tensor, me: int
) -> list[Share]:
    """Who holds what of bucket ``index`` of ``plan``, whose bytes are ``bucket`` (a
    ``meta`` tensor where only ``me``'s local views matter), in the order both sides of
    the lane take them; a tensor held whole is rank 0's (``agang._weights.sharding``
    rule 1)."""
    out: list[Share] = []
    for tensor, offset, nbytes, start in plan.buckets()[index][2]:
        layout = layouts[tensor]
        row = plan.row_bytes(tensor)
        rows = (start // row, (start + nbytes) // row)
        part = layout.rows_of(bucket[offset : offset + nbytes], rows)
        for rank in range(1 if layout.everywhere else len(layout.spans)):
            share = layout.share(rank, rows)
            if share is not None:
                dim, at, length, local_at, local_length = share
                local = layout.local_rows(local_at, local_length) if rank == me else None
                out.append((rank, part.narrow(dim, at, length), local))
    return out


def control(
    what: int, version: int, attempt: int, device: torch.device, text: bytes = b""
) -> torch.Tensor:
    """A word of the lane (rule 2): its three int64 and ``text`` (at most
    ``INLINE_BYTES``), as ``WORD_BYTES`` bytes."""
    word = bytearray(WORD_BYTES)
    word[: 8 * CONTROL_WORDS] = struct.pack("<3q", what, version, attempt)
    word[8 * CONTROL_WORDS : 8 * CONTROL_WORDS + len(text)] = text
    return torch.frombuffer(word, dtype=torch.uint8).to(device)


def read_control(word: torch.Tensor) -> tuple[int, int, int, bytes]:
    """``control``'s int64 and what follows them, from a word received."""
    raw = bytes(word.cpu().numpy())
    what, value, spare = struct.unpack_from("<3q", raw)
    return what, value, spare, raw[8 * CONTROL_WORDS :]


class Gathering:
    """Rank 0's buckets, gathered over ``lane`` (module rules)."""

    def __init__(self, plan: Plan, layouts: list[Layout], lane: Gang) -> None:
        self.plan = plan
        self._layouts = layouts
        self._lane = lane
        self._device = layouts[0].local.device
        self._sizes = [nbytes for _, nbytes, _ in plan.buckets()]
        self.bucket0 = self._zeros(self._sizes[0])
        ring = max(self._sizes[1:], default=0)
        self._ring = [self._zeros(ring) for _ in range(min(RING, len(self._sizes) - 1))]
        self._scratch: torch.Tensor | None = None  # made where a share is strided
        self._copied: set[int] = set()  # direct buckets an old op holds: copied (rule 3)
        self._plans = [self._cut(index) for index in range(len(self._sizes))]
        #: Why the lane is no longer in step (rule 4), or None.
        self.broken: str | None = None
        # The round under way (rule 5): the next bucket to take (None: no round), and
        # that bucket's receives, where they were issued.
        self._open_round: int | None = None
        self._receiving: list[Handle[list[torch.Tensor]]] | None = None
        # Words said on the lane and not seen through yet (rule 2): each is awaited
        # before the next words, not by the push that said them.
        self._said: list[Handle[Any]] = []

    def _zeros(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8, device=self._device)

    @property
    def allocated_bytes(self) -> int:
        """The bytes of the sender's buffers (rule 3)."""
        scratch = 0 if self._scratch is None else self._scratch.numel()
        return self.bucket0.numel() + sum(r.numel() for r in self._ring) + scratch

    @property
    def count(self) -> int:
        """The buckets of a round."""
        return len(self._sizes)

    def wire(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s buffer (rule 3)."""
        if index == 0:
            return self.bucket0
        return self._ring[(index - 1) % len(self._ring)][: self._sizes[index]]

    def slot_user(self, index: int) -> int | None:
        """The bucket before ``index`` in its ring buffer, whose broadcast must end
        first (rule 3); None for bucket 0 and the first turn of the ring."""
        before = index - len(self._ring)
        return before if index > 0 and before >= 1 else None

    def _cut(self, index: int) -> tuple[list[Copy], list[Receive], torch.Tensor | None]:
        """Bucket ``index``'s own copies (into, from), its receives (rank, into, the
        strided place ``into`` is copied to after, or None), and, for a direct bucket
        that is rows of rank 0's own tensor, those rows' bytes: it moves as they are,
        with no copy (rule 3)."""
        own: list[Copy] = []
        receives: list[Receive] = []
        used = 0
        for rank, place, local in shares(self.plan, self._layouts, index, self.wire(index), 0):
            if local is not None:
                own.append((place, local))
            elif place.is_contiguous():
                receives.append((rank, place, None))
            else:
                if self._scratch is None:  # each share at an aligned offset
                    most = max(len(parts) for _, _, parts in self.plan.buckets())
                    self._scratch = self._zeros(max(self._sizes) + ALIGN * most)
                size = place.numel() * place.element_size()
                landing = self._scratch[used : used + size].view(place.dtype).view(place.shape)
                used = (used + size + ALIGN - 1) // ALIGN * ALIGN
                receives.append((rank, landing, place))
        direct = self.plan.buckets()[index][0] and index not in self._copied
        if direct and not receives and len(own) == 1 and own[0][0].is_contiguous():
            return [], [], as_bytes(own[0][1])
        return own, receives, None

    def renew_held(self, holds: list[Gang]) -> None:
        """New buffers for those an op of a failed round still holds (``Gang.holds``;
        ``agang._weights.buckets`` rule 6)."""
        renewed = False
        if any(gang.holds(self.bucket0) for gang in holds):
            self.bucket0 = self._zeros(self.bucket0.numel())
            renewed = True
        for slot, buffer in enumerate(self._ring):
            if any(gang.holds(buffer) for gang in holds):
                self._ring[slot] = self._zeros(buffer.numel())
                renewed = True
        for index, (_, _, view) in enumerate(self._plans):
            if view is not None and any(gang.holds(view) for gang in holds):
                self._copied.add(index)  # the tensor's rows are busy: copied from now on
                renewed = True
        if renewed:
            self._plans = [self._cut(index) for index in range(self.count)]

    def _renew_slot(self, index: int) -> None:
        """A new ring buffer for bucket ``index``, where the broadcast of the bucket
        before in it failed: c10d may not have ended that op, which holds the old one
        (rule 3; ``agang._weights.buckets`` rule 6). Only the failed rounds pay it."""
        slot = (index - 1) % len(self._ring)
        self._ring[slot] = self._zeros(self._ring[slot].numel())
        for at in range(1 + slot, self.count, len(self._ring)):
            self._plans[at] = self._cut(at)

    async def begin(self, version: int, deadline: float) -> None:
        """Says a round of ``version`` starts (rule 2): the ranks send their shares."""
        self._check()
        await self._finish_taking(deadline)  # a round left open by a cancel (rule 5)
        await self.settle()
        self._say(control(ROUND, version, 0, self._device), bound(deadline, 0.001))
        self._open_round = 0

    async def take(self, index: int, deadline: float, before: Handle[Any] | None) -> torch.Tensor:
        """Bucket ``index`` of the round, gathered (rules 1, 3), once the broadcast
        ``before`` (its ring buffer's last) ended, well or not."""
        if before is not None:
            try:
                await before
            except GangError:  # the fleet's failure: the round's own
                if self._receiving is None:  # the failed op may still hold its buffer
                    self._renew_slot(index)
        assert self._open_round == index, (self._open_round, index)
        own, receives, direct = self._plans[index]
        if direct is not None:
            self._open_round = index + 1 if index + 1 < self.count else None
            return direct
        if self._receiving is None:
            # One batch a bucket: one op, however many shares (``Gang.exchange``).
            pairs = [(into, rank) for rank, into, _ in receives]
            least = CANCEL_GRACE + self._sizes[index] / GRACE_BYTES_PER_SECOND  # rule 4
            seconds = max(bound(deadline, 0.001), least)
            self._receiving = [self._lane.exchange(recvs=pairs, timeout=seconds)] if pairs else []
            for into, came in own:
                copy_views(into, came)
        await self.settle()  # the round's word, posted before these receives
        for handle in self._receiving:
            await self._op(handle)
        self._receiving = None
        for _, landing, place in receives:
            if place is not None:
                copy_views(place, landing)
        self._open_round = index + 1 if index + 1 < self.count else None
        return self.wire(index)

    async def end(self, outcome: dict[str, Any], seconds: float = END_SECONDS) -> None:
        """Ends the push on the lane with ``outcome`` (rule 2): ``{"version": v,
        "report": ...}``, ``{"version": v, "error": why}`` or ``{"closed": why}``, within
        ``seconds``, shielded from a cancel: once said, the push's words are whole
        whatever becomes of the caller (a second end would put the lane out of step).
        Where the lane is out of step, nothing is said."""
        if self.broken is not None:
            return
        with anyio.CancelScope(shield=True):
            await self._finish_taking(time.monotonic() + seconds)
            await self.settle()
            text = json.dumps(outcome).encode()
            inline = len(text) <= INLINE_BYTES
            self._say(control(DONE, len(text), 0, self._device, text if inline else b""), seconds)
            if not inline:
                long = torch.frombuffer(bytearray(text), dtype=torch.uint8)
                self._say(long.to(self._device), seconds)

    def _say(self, word: torch.Tensor, seconds: float) -> None:
        """Sends ``word`` to every other rank (rule 2)."""
        sends = [(word, rank) for rank in range(1, self._lane.size)]
        if sends:
            self._said.append(self._lane.exchange(sends=sends, timeout=seconds))

    async def settle(self) -> None:
        """Sees the words said on the lane through (rule 2)."""
        while self._said:
            said = self._said.pop(0)  # one task awaits each (a close may settle too)
            await self._op(said)

    async def abandon(self, why: str, version: object) -> None:
        """A push of ``version`` that raised or was cancelled, ended on the lane within
        its grace (rule 5), else the lane closed (rule 4). Called shielded."""
        if self.broken is not None:
            return
        left = 0 if self._open_round is None else sum(self._sizes[self._open_round :])
        seconds = CANCEL_GRACE + left / GRACE_BYTES_PER_SECOND
        with anyio.move_on_after(seconds) as grace:
            try:
                await self.end({"version": version, "error": why}, seconds)
            except GangError:
                return  # broken, and closed, by ``_op``
        if grace.cancelled_caught:
            self._break(f"a push that ended early ({why}) could not end on the lane in time")

    async def close(self, why: str) -> None:
        """Tells the other ranks the publisher closed: their next push raises
        ``GangClosedError`` (rule 2). The words are said, not waited for (a rank that
        pushes no more never takes them: the gang's close ends them)."""
        if self.broken is not None:
            return
        with anyio.move_on_after(END_SECONDS), contextlib.suppress(GangError):
            await self.end({"closed": why})

    async def _finish_taking(self, deadline: float) -> None:
        """Takes the rest of a round left open (cancelled), sending nothing on (rule 5)."""
        while self._open_round is not None:
            await self.take(self._open_round, deadline, None)

    async def _op(self, handle: Handle[Any]) -> Any:
        """Awaits an op of the lane; one that fails breaks it (rule 4)."""
        try:
            return await handle
        except GangError as error:
            self._break(one_line(error))
            raise

    def _check(self) -> None:
        if self.broken is not None:
            raise GangError(f"the lane to the other trainer ranks is out of step: {self.broken}")

    def _break(self, why: str) -> None:
        """The lane is out of step for good: closed, so the other ranks' ops end (rule 4)."""
        if self.broken is None:
            self.broken = why
        start_daemon(self._lane.close_sync, name="agang: weights: close the trainer lane")
