"""The subscriber's side of every round, on a thread and an asyncio loop of its own.

Rules:
1. *Never waits for the application.* Once admitted, the service takes part in every
   round whatever the application's own loop or threads are doing; the application
   takes the newest version when it chooses (``WeightSubscriber.receive``).
2. *A round.* Bucket 0 arrives in a buffer of its own (its header says what follows);
   for ``DATA`` the service then holds the staging lock, posts the other buckets'
   receives, straight into the staging buffers (or, in place, into the user's tensors;
   there a packed bucket is copied out as soon as it came), swaps bucket 0's buffer in
   (``agang._weights.buckets`` rule 8), says a version is ready and confirms it to the
   publisher. The version is ready once its last bucket came, whatever becomes of its
   confirmation: a server stopped as it confirmed (the publisher took the
   confirmation, the send's end was not reported yet) wakes to find the publisher gone
   from the epoch, with its bytes whole, and the publisher counted it delivered.
   ``receive`` copies the staging buffers into the user's tensors under the same lock,
   so it never reads half a version, and a round waits for that copy at most. A round
   that would overwrite a version the application has not taken yet first looks at
   the store: one whose epoch the publisher left already (it came to a server stopped
   across the push) is not taken, so the version held stays whole.
3. *Membership.* The service registers, waits for an epoch that lists it, checks in,
   and makes the group once the publisher says go. ``REFORM`` moves it to the epoch
   named. A failed epoch's group is closed at once, on a thread of its own: its close
   can take seconds, and the next epoch's first round must not wait; and a member that
   waits on this one in Gloo's broadcast tree sees its round end.
   Its group failing, it looks at the store for what happened: a newer epoch
   that lists it (it goes on there), a drop (it registers again, to be admitted at a
   later push; a drop because another subscriber of its name replaced it ends it), or
   the publisher gone (closed, fenced, or seen silent: ``agang._weights.upstream``), or
   the store gone for longer than the subscriber's timeout: each ends the service with
   an error that says which, for ``receive`` to raise. What the publisher and the
   store say comes from the subscriber's upstream thread, so a round never waits for
   the store.
   The publisher deletes a dead epoch's keys (``agang._weights.channel`` rule 6): an
   epoch whose members are gone, or whose go is gone while a later epoch exists, was
   left behind (its go was said before the later epoch was written), and the service
   looks for the next one.
4. Every wait is bounded: by the subscriber's timeout within a round, by
   ``PUBLISHER_GONE`` while the publisher does not beat, and by ``close``.
6. Tied tensors (``agang._weights.plan`` rule 4) are copied into their aliases once a
   version came whole, before it is ready (in place), or as ``receive`` copies it.
7. *A sharded server* (``WeightSubscriber.open(..., gang=)``): the service runs on its
   rank 0 alone, and a ``DATA`` round goes through its ``Relay``
   (``agang._weights.relay``): the buckets pass through a ring of buffers into this
   rank's staging and on to the other ranks, and the version is ready, and confirmed,
   once every rank acknowledged it. A rank lost (the relay broken) gives the whole
   server up: the service reports its own member dead to the publisher, naming the
   lost rank (``agang.report_death``: the publisher ends the round at once and drops
   it with that why), waits (bounded) for the publisher to move on, and ends with an
   error naming the rank. The stale round of rule 2 is looked for first, as on a whole
   server: one not taken leaves the lane untouched, so every rank keeps the version it
   holds, which ``receive`` may still take on every rank.
5. A buffer that an op of a failed epoch still holds (``Gang.holds``, asked of that
   epoch's gang) is replaced before the next epoch's rounds (``agang._weights.buckets``
   rule 6). A version held whole is never in
   such a buffer: the round that failed had marked staging as being written. In place,
   the op may be one that writes the server's own tensor; it was the failed round's,
   whose bytes the server may already be reading anyway (in place is for servers that
   pause serving during an update).
8. *Its status* (what the publisher's status probe, and a ``receive`` that timed
   out, say it is doing) says where it stands in its rounds; once the service ended,
   that it ended and why (the error ``receive`` raises, or that it was closed).
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import torch

from agang._errors import GangClosedError, GangError, one_line
from agang._gang import Gang
from agang._membership import deaths
from agang._membership.gangs import GangFactory
from agang._membership.member import Member
from agang._runtime.future import Future, finish
from agang._runtime.threads import start_daemon
from agang._weights.buckets import Buckets, header_of
from agang._weights.channel import Channel, closed_by_fence, in_group
from agang._weights.epoch import CLOSE, DATA, REFORM, gang_name
from agang._weights.relay import Relay
from agang._weights.upstream import Upstream

T = TypeVar("T")

STOP_GRACE = 1.0
_POLL = 0.02
_IDLE_LOOK = 0.1


class Service:
    """The subscriber ``me``'s rounds on ``channel`` into ``buckets`` (module rules)."""

    def __init__(
        self,
        channel: Channel,
        buckets: Buckets | None,
        me: Member,
        timeout: float | None,
        upstream: Upstream,
        factory: GangFactory,
        relay: Relay | None = None,
    ) -> None:
        self.channel = channel
        self.buckets = buckets
        self.relay = relay  # a sharded server's rank 0 (rule 7)
        self.me = me
        self.timeout = timeout  # a round's bound on this side, and a wait's (None: none)
        self.upstream = upstream
        self._factory = factory
        self.staging = threading.Lock()  # rule 2
        self._state = threading.Lock()
        self.ready: int | None = None  # the newest whole version in staging (or in place)
        self.taken: int | None = None  # the newest version ``receive`` took (under staging)
        self.error: GangError | None = None
        self.status = "registered, waiting to be admitted at the next push"
        self._news: Future[None] = Future("weights news")
        self._stopping = threading.Event()
        self._epoch = -1
        if relay is not None:
            self._bucket0 = torch.zeros(relay.first_bytes, dtype=torch.uint8, device=relay.device)
        else:
            assert buckets is not None
            self._bucket0 = buckets.spare0  # swapped into staging by a DATA round
        self._gang: Gang | None = None
        self._closing: Gang | None = None  # a failed epoch's, to close
        self._old: list[Gang] = []  # failed epochs' gangs, whose ops may hold buffers
        self._closers: list[threading.Thread] = []  # the threads closing them
        self._drop_seen: str | None = None
        self._thread = start_daemon(self._run, name=f"agang: weights subscriber {me.name}")

    def news(self) -> Future[None]:
        """A future that finishes at the next version or error."""
        with self._state:
            return self._news

    def _tell(self) -> None:
        with self._state:
            news, self._news = self._news, Future("weights news")
        finish(news, None, None)

    def _say(self, status: str) -> None:
        self.status = status

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except GangError as error:
            self.error = error
        except Exception as error:  # the store failed under a call, or a bug
            self.error = GangError(
                f"Subscriber '{self.me.name}' lost the channel '{self.channel.name}': "
                f"{self._store_or(error)}"
            )
            self.error.__cause__ = error
        finally:
            closing, self._closing = self._closing, None
            if closing is not None:
                closing.close_sync()
            ended = self.error
            why = f"subscriber '{self.me.name}' was closed" if ended is None else str(ended)
            self._say(f"ended: {why}")  # rule 8
            if self.relay is not None:  # the other ranks' rounds end with this one's, and why
                self.relay.close(why, isinstance(ended, GangClosedError))
            self._tell()

    def _store_or(self, error: BaseException) -> str:
        try:
            self.channel.store.check(["agang/weights/ping"])
        except Exception as lost:
            return f"the store at {self.channel.address} went away ({one_line(lost).rstrip('.')})."
        return one_line(error)

    def _try(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, a store op, or ``default`` where the store failed: the upstream
        thread connects again and says how long the store has been gone (rule 3)."""
        try:
            return fn()
        except Exception:
            return default

    def _members(self, epoch: int) -> list[Member]:
        """``epoch``'s members, none where they are unknown or the store failed."""
        return self._try(functools.partial(self.channel.members, epoch), None) or []

    def _check_in(self, epoch: int) -> bool:
        self.channel.check_in(epoch, self.me.uid)
        return True

    def _deadline(self) -> float:
        return time.monotonic() + (math.inf if self.timeout is None else self.timeout)

    async def _main(self) -> None:
        while not self._stopping.is_set():
            epoch = self._wait_for_epoch()
            if epoch is None:
                return
            next_epoch = await self._serve(epoch)
            if next_epoch is None:
                return

    def _publisher_gone(self) -> str | None:
        """Why the publisher can send no more (rule 3), or None: what the upstream
        thread's last look found."""
        return self.upstream.gone

    def _lost(self, why: str, *, closed: bool = False) -> GangError:
        """The service's end: ``GangClosedError`` where the publisher closed the channel
        (``closed``: a close round came; or the upstream thread saw the close), a normal
        end, however this subscriber learned of it; else the loss, and why."""
        if closed or self.upstream.closed_normally:
            return GangClosedError(
                f"Subscriber '{self.me.name}': the publisher "
                f"({self._try(self.channel.publisher, 'unknown')}) closed the channel "
                f"'{self.channel.name}'; the last version it sent is the last one."
            )
        return GangError(
            f"Subscriber '{self.me.name}' lost the channel '{self.channel.name}': {why}."
        )

    def _wait_for_epoch(self) -> int | None:
        """The first epoch past this one that lists this subscriber (rule 3)."""
        seen = self._epoch
        while not self._stopping.is_set():
            newest = self.upstream.newest
            while seen < newest:
                seen += 1
                members = self._members(seen)
                if any(m.uid == self.me.uid for m in members):
                    self._epoch = seen
                    return seen
            self._epoch = max(self._epoch, seen)
            self._register_again_if_dropped()
            gone = self._publisher_gone()
            if gone is not None:
                raise self._lost(gone)
            time.sleep(_POLL)
        return None

    async def _serve(self, epoch: int) -> int | None:
        """Serves ``epoch``'s rounds until it ends; the epoch to look for next (rule 3)."""
        members = self._members(epoch)
        rank = next((i for i, m in enumerate(members) if m.uid == self.me.uid), None)
        if rank is None:  # the epoch is dead and its keys deleted already (rule 3)
            return epoch + 1
        if not self._try(functools.partial(self._check_in, epoch), False):
            return await self._after_failure(epoch, "the store failed as it checked in")
        self._say(f"admitted to epoch {epoch} as rank {rank}; waiting for the go")
        give_up_at = self._deadline()
        while (go := self._try(lambda: self.channel.go(epoch), None)) is None:
            if self._stopping.is_set():
                return None
            if self.upstream.newest > epoch:  # its go was said, and deleted since (rule 3)
                return epoch + 1
            if time.monotonic() > give_up_at:
                return await self._after_failure(epoch, "no go to make its group")
            await asyncio.sleep(_POLL)
        if go != "go":
            return epoch + 1
        try:
            self._gang = self._factory(
                self.channel.group_store(),
                self.channel.group_prefix(epoch),
                rank=rank,
                members=members,
                name=gang_name(self.channel.name, self.channel.session, epoch),
                timeout=self.timeout or 3600.0,
                op_timeout=None,
            )
        except Exception as error:
            return await self._after_failure(
                epoch, f"its group could not be made: {one_line(error)}"
            )
        self._close_old()  # on a thread of its own: this epoch's rounds do not wait for it
        self._renew_held()
        self.upstream.member = True
        try:
            return await self._rounds(epoch)
        finally:
            self.upstream.member = False
            gang, self._gang = self._gang, None
            if gang is not None:
                self._old.append(gang)
                await gang.close()

    async def _rounds(self, epoch: int) -> int | None:
        gang = self._gang
        assert gang is not None
        confirming: Any = None  # the last version's confirmation, sent, maybe not done
        while not self._stopping.is_set():
            self._say(in_group(epoch, f"waiting for a round (holds version {self.ready})"))
            # The next round's bucket 0 is posted before the last confirmation is seen
            # through: a publisher that took it starts the next push at once, and the
            # round must not wait for this side's loop to learn that a send ended.
            try:
                coming = gang.broadcast(self._bucket0, 0, timeout=None)
            except GangError as error:  # broken: the last confirmation's send failed
                return await self._after_failure(epoch, one_line(error))
            if confirming is not None:
                unconfirmed, confirming = await self._confirmed(confirming, epoch), None
                if unconfirmed is not None:
                    return await self._after_failure(epoch, unconfirmed)
            try:
                moved = await self._watch([coming], epoch)
            except GangError as error:
                return await self._after_failure(epoch, one_line(error))
            if moved is not None:  # the publisher left this epoch without telling it
                return await self._after_failure(epoch, moved)
            what, version, named, _ = header_of(self._bucket0).tolist()
            if what == REFORM:
                self._say(f"moving from epoch {epoch} to epoch {named}")
                return int(named)
            if what == CLOSE:
                why = self._why_closed()
                raise self._lost(why, closed=not closed_by_fence(why))
            if what != DATA:
                raise self._lost(f"a round of epoch {epoch} had an unknown header {what}")
            if self._stale(epoch):  # rule 2, on a sharded server's rank 0 too (rule 7)
                return await self._after_failure(
                    epoch, f"the publisher moved on from epoch {epoch} before its round came"
                )
            self._say(in_group(epoch, f"receiving version {version}"))
            if self.relay is not None:  # rule 7
                with self.staging:
                    self.ready = None
                    try:
                        moved = await self.relay.round(
                            gang,
                            self._bucket0,
                            int(version),
                            epoch,
                            functools.partial(self._watch, epoch=epoch),
                            self.timeout or math.inf,
                        )
                    except GangError as error:
                        moved = one_line(error)
                    if moved is None:
                        self.ready = int(version)
                if self.relay.broken is not None:
                    await self._give_up(epoch, self.relay.broken)
                if moved is not None:
                    return await self._after_failure(epoch, moved)
                try:
                    on = self._bucket0.device
                    ack = torch.tensor([version, epoch], dtype=torch.int64, device=on)
                    confirming = gang.send(ack, 0, timeout=self.timeout or math.inf)
                except GangError as error:
                    return await self._after_failure(epoch, one_line(error))
                self._say(in_group(epoch, f"holds version {version}"))
                self._tell()
                continue
            buckets = self.buckets
            assert buckets is not None
            with self.staging:
                self.ready = None  # rule 2: staging is being written
                try:  # posted first: the publisher sends them as soon as they are
                    handles = [
                        gang.broadcast(wire, 0, timeout=self.timeout or math.inf)
                        for wire in buckets.wire[1:]
                    ]
                except GangError as error:  # an earlier bucket's receive broke the gang
                    return await self._after_failure(epoch, one_line(error))
                self._bucket0 = buckets.swap0()  # bucket 0 is staging's, not copied
                # In place, each packed bucket is copied out as soon as it came, while
                # the next ones move (its tensors are the server's, written anyway).
                landed = buckets.unpack_bucket if buckets.in_place else None
                if landed is not None:
                    landed(0)
                try:
                    moved = await self._watch(handles, epoch, landed, first=1)
                except GangError as error:
                    return await self._after_failure(epoch, one_line(error))
                if moved is not None:
                    return await self._after_failure(epoch, moved)
                if buckets.in_place:
                    buckets.tie()  # rule 6
                # Whole now, whatever becomes of the confirmation (rule 2).
                self.ready = int(version)
                try:
                    on = buckets.wire[0].device  # the gang's (NCCL: the GPU)
                    ack = torch.tensor([version, epoch], dtype=torch.int64, device=on)
                    confirming = gang.send(ack, 0, timeout=self.timeout or math.inf)
                except GangError as error:
                    return await self._after_failure(epoch, one_line(error))
            self._say(in_group(epoch, f"holds version {version}"))
            self._tell()
        if confirming is not None:  # stopping: the last confirmation goes out first
            await self._confirmed(confirming, epoch)
        return None

    async def _give_up(self, epoch: int, why: str) -> None:
        """A rank of this sharded server was lost (rule 7): the publisher is told, and
        given (bounded) time to move on; then the service ends naming the rank."""
        said = f"subscriber '{self.me.name}' gave its whole server gang up: {why}"
        notice = deaths.Notice(self.me.uid, said, f"{self.me.name} (its server's rank 0)")
        self._try(functools.partial(deaths.report, self.channel.store, notice), 0)
        give_up_at = time.monotonic() + min(self.timeout or 10.0, 10.0)
        while time.monotonic() < give_up_at and not self._stopping.is_set():
            if self.upstream.newest > epoch or self.upstream.dropped is not None:
                break
            await asyncio.sleep(_POLL)
        raise self._lost(f"its server gang lost a rank: {why}")

    async def _confirmed(self, sent: Any, epoch: int) -> str | None:
        """Sees a confirmation's send through; why it was not, or None."""
        try:
            return await self._watch([sent], epoch)
        except GangError as error:
            return one_line(error)

    def _stale(self, epoch: int) -> bool:
        """Whether a round that came would overwrite a version the application has not
        taken yet, for nothing: the publisher left ``epoch`` already (rule 2). A server
        stopped across a push reads that push's bytes from its socket when it wakes,
        long after the publisher gave up on it; taking them lost the version it held,
        which was delivered. One look at the store, only while a version waits."""
        if self.ready is None or self.ready == self.taken:
            return False
        return self.upstream.newest_now() > epoch

    def _renew_held(self) -> None:
        """New buffers for those an op of a failed epoch still holds (rule 5): c10d
        cannot cancel an op, and one behind a dead link went on for seconds after its
        group's abort; this epoch's rounds must neither wait for it nor fail on it."""
        old, self._old = self._old, []
        if not old:
            return
        if any(gang.holds(self._bucket0) for gang in old):
            self._new_bucket0()
        if self.relay is not None:
            self.relay.renew_held(old)
            return
        assert self.buckets is not None
        with self.staging:
            for index, wire in enumerate(self.buckets.wire):
                if any(gang.holds(wire) for gang in old):
                    self.buckets.renew(index)

    def _new_bucket0(self) -> None:
        """A new buffer for the rounds' bucket 0 (rule 5): the spare of the staging's
        bucket 0, where this server has staging buckets."""
        if self.buckets is not None:
            self._bucket0 = self.buckets.renew_spare0()
        else:
            self._bucket0 = torch.zeros_like(self._bucket0)

    def _close_old(self) -> None:
        """Closes the failed epoch's gang on a thread of its own, as it failed (rule 3).
        Its close can take seconds (Gloo's destructor waits for an aborted op that no
        closed pair ended), while the publisher gives the next epoch's first round only
        what is left of its recovery bound: a survivor that waited for it was dropped.
        Its idle wait may still hold bucket 0's buffer, so the next epoch takes a new
        one."""
        closing, self._closing = self._closing, None
        if closing is None:
            return
        self._new_bucket0()
        self._old.append(closing)
        self._closers.append(
            start_daemon(closing.close_sync, name=f"agang: weights: close gang '{closing.name}'")
        )

    async def _watch(
        self,
        handles: list[Any],
        epoch: int,
        landed: Callable[[int], None] | None = None,
        first: int = 0,
    ) -> str | None:
        """Awaits ``handles``, looking at the store every ``_IDLE_LOOK`` seconds; returns
        why it stopped waiting where the publisher moved to a later epoch (rule 3).
        ``landed(first + i)`` runs as soon as ``handles[i]`` ended well. Without it,
        the last is awaited first: it ends last, and a handle that ended before it is
        awaited costs no wake-up of the loop (one a round, not one a bucket)."""
        order = list(enumerate(handles, first))
        if landed is None:
            order.reverse()
        for index, handle in order:
            while not handle.done():
                with anyio.move_on_after(_IDLE_LOOK):
                    await handle
                if handle.done():
                    break
                if self.upstream.newest > epoch:
                    return f"the publisher moved on from epoch {epoch}"
                if self.upstream.gone is not None:
                    return self.upstream.gone
                if self._stopping.is_set():
                    return "closing"
            await handle
            if landed is not None:
                landed(index)
        return None

    async def _after_failure(self, epoch: int, error: str) -> int | None:
        """Rule 3: what happened to ``epoch``, from the store; the epoch to look at next."""
        # Closed now, on a thread of its own (closing may wait up to 2 s for the aborted
        # ops' ends, which the others must not wait for): a member behind this one in
        # Gloo's broadcast tree waits on this one's connections, not the publisher's,
        # and must see the round end too, or the publisher takes it for stalled
        # (``agang._weights.admission`` rule 3).
        if self._gang is not None:
            self._closing, self._gang = self._gang, None
            self._close_old()
        self._say(f"lost epoch {epoch}'s group ({error}); looking for the next epoch")
        give_up_at = self._deadline()
        while not self._stopping.is_set():
            newest = self.upstream.newest
            for later in range(epoch + 1, newest + 1):
                members = self._members(later)
                if any(m.uid == self.me.uid for m in members):
                    self._epoch = later - 1
                    return later
            if newest > epoch and self._register_again_if_dropped():
                self._epoch = newest
                return newest
            gone = self._publisher_gone()
            if gone is not None:
                raise self._lost(f"{gone}; its group had failed: {error}")
            if time.monotonic() > give_up_at:
                raise self._lost(
                    f"its group of epoch {epoch} failed ({error}), and the publisher "
                    f"({self._try(self.channel.publisher, 'unknown')}) neither made a new "
                    f"epoch nor dropped it "
                    f"within {self.timeout:g} s"
                )
            if self.upstream.trouble is not None:  # the store's, not the publisher's
                give_up_at = max(give_up_at, self._deadline())
            await asyncio.sleep(_POLL)
        return None

    def _register_again_if_dropped(self) -> bool:
        """Registers again after a drop not seen before (rule 3); True if it did."""
        why = self.upstream.dropped
        if why is None or why == self._drop_seen:
            return False
        self._drop_seen = why
        if why.startswith("replaced"):
            raise self._lost(f"the publisher dropped it: {why}")
        self._say(f"dropped ({why}); registered again")
        if not self._try(lambda: self.channel.register(self.me) >= 0, False):
            self._drop_seen = None  # the store failed: register at the next look
            return False
        return True

    def _why_closed(self) -> str:
        closed = self._try(self.channel.closed, None)
        if closed is not None and closed_by_fence(closed):
            return closed
        return f"the publisher ({self._try(self.channel.publisher, 'unknown')}) closed the channel"

    def stop(self, seconds: float) -> None:
        """Ends the service: its waits end within a poll (``_IDLE_LOOK``), after the last
        version's confirmation is seen through, and it closes its group; one that has
        not ended within ``STOP_GRACE`` s has its group closed under it. A close right
        after ``receive`` returned used to close the group under the confirmation: the
        publisher's round then failed, though the version had come whole."""
        self._stopping.set()
        give_up_at = time.monotonic() + seconds
        self._thread.join(min(seconds, STOP_GRACE))
        gang = self._gang
        if gang is not None:
            gang.close_sync()  # a wait on bucket 0 ends with the gang
        self._thread.join(max(0.0, give_up_at - time.monotonic()))
        for closer in self._closers:  # a failed epoch's gang, closed by now (its memory free)
            closer.join(max(0.0, give_up_at - time.monotonic()))
