"""The trainer's side: ``WeightPublisher``.

Rules:
1. *Membership at round boundaries.* A push first reads the registrations, where its
   beat saw new ones (``agang._weights.channel`` rule 2): every registered subscriber
   whose beat is fresh is admitted, and the members then move to
   a new epoch (the old gang is told ``REFORM`` in bucket 0's header, the new members
   are written, every one checks in, then all make the new group). A joiner with the
   name of a member replaces it (a restarted server).
2. *A round* sends the buckets in order, each filled just before it is issued (the
   next one fills while the last one moves), then takes each subscriber's confirmation
   (its version and epoch, sent to rank 0). The whole round has the push's deadline.
3. *Recovery.* A round that fails (a deadline: the gang aborts; a lost connection)
   leaves the subscribers that confirmed delivered; the others are asked where they
   stand (blame, :mod:`agang._weights.channel` rule 5). Those that do not answer are
   dropped, with why; the rest move to a new epoch without them and the round runs
   again there, once, within ``RECOVERY_SECONDS`` (plus the time the bytes take at
   ``RECOVERY_BYTES_PER_SECOND``) after the failure; a bucket that an op of the failed
   round still holds moves in a new buffer (``agang._weights.buckets`` rule 6). A
   member that fails the second round too is dropped. So a push returns within its
   deadline plus that bound, and never raises for a lost server.
4. A member that does not come to make a new epoch's group within
   ``CHECK_IN_SECONDS`` is dropped, and the epoch after is made without it, within the
   recovery's bound from then; a joiner that did not come gives the round that follows
   that bound too, so that the members are not dropped for the time it took. Every step
   is bounded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import time
from collections.abc import Mapping

import torch

from agang._backends.c10d.retry import one_line
from agang._collective.process_group_gang import ProcessGroupGang
from agang._engine import busy
from agang._errors import GangBrokenError, GangError
from agang._runtime.threads import start_daemon
from agang._weights import channel as channel_keys
from agang._weights import checks
from agang._weights.blocking import beat, blocking, bound, run_sync
from agang._weights.buckets import Buckets
from agang._weights.channel import Channel
from agang._weights.epoch import CLOSE, DATA, REFORM, Member, make_gang
from agang._weights.housekeeping import Housekeeping
from agang._weights.plan import DEFAULT_BUCKET_BYTES, Plan
from agang._weights.report import PushReport

#: The recovery's bound after a failure (plus the bytes' time): a push that lost a
#: subscriber returns at most this long after its failure (measured in the tests, under
#: load: 0.35-0.42 s after a kill, 0.37-0.39 s past the deadline after a stop). A
#: survivor closes the failed epoch's gang on a thread of its own, so that close, which
#: can take seconds, is not in it.
RECOVERY_SECONDS = 2.0
RECOVERY_BYTES_PER_SECOND = 200e6
CHECK_IN_SECONDS = 2.0
_POLL = 0.01
_NO_ANSWER = "no answer (dead, stopped, or cut off from the store)"


class WeightPublisher:
    """Pushes a ``state_dict``'s values to the subscribers of a channel, whoever they
    are at each push. Open it with :meth:`open`.

    Example:
        >>> publisher = await agang.WeightPublisher.open(model.state_dict(),
        ...     store="10.0.0.1:29500", channel="policy")
        >>> report = await publisher.push(step)
    """

    def __init__(
        self, channel: Channel, plan: Plan, tensors: dict[str, torch.Tensor], timeout: float | None
    ) -> None:
        self._channel = channel
        self._plan = plan
        self._buckets = Buckets(plan, tensors, publisher=True, in_place=True)
        self._timeout = timeout
        self._me = Member("publisher", "publisher", f"{socket.gethostname()}, pid {os.getpid()}")
        self._members: list[Member] = []  # the subscribers of the current epoch, by rank - 1
        self._pending: dict[str, Member] = {}  # registered, not admitted yet
        self._handled = 0  # the count of registrations and leaves the last look read
        self._leaving: set[str] = set()  # members that closed, dropped at the next push
        self._keeping = Housekeeping(channel)
        self._may_be_held = False  # a failed round's ops may hold buckets (rule 3)
        self._registered = 0  # registrations the beat saw (channel rule 2)
        self._gang: ProcessGroupGang | None = None
        self._epoch = -1
        self._last: int | None = None
        self._busy = False
        self._closed = False
        self._stop_beat = beat(self._beat, "publisher")

    @classmethod
    async def open(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        timeout: float | None = 60.0,  # noqa: ASYNC109  # the default deadline of open and push
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> WeightPublisher:
        """Opens ``channel`` on the ``agang store`` at ``store`` ("HOST:PORT") and writes
        the plan of ``tensors`` there; subscribers may open before or after.

        Args:
            tensors: Names to contiguous CPU tensors (a ``state_dict()``): what each push
                sends, read during the push (do not change them until it returns).
            store: The store's "HOST:PORT".
            channel: The channel's name; subscribers name the same.
            timeout: The store connection's deadline, and each push's default one
                (seconds; None: none for pushes, 60 s for connecting).
            bucket_bytes: The most bytes of small tensors packed into one broadcast.

        Raises:
            GangInitError: The store did not answer before the deadline.
        """
        checked = checks.check_tensors(tensors)
        host, port = checks.check_store(store)
        name = checks.check_channel(channel)
        seconds = checks.check_timeout(timeout)
        plan = Plan.of(checked, bucket_bytes)
        where = f"{socket.gethostname()}, pid {os.getpid()}"
        connect_for = 60.0 if seconds is None else seconds
        opened = await blocking(
            lambda: Channel.start(
                channel_keys.connect(host, port, time.monotonic() + connect_for),
                name,
                plan.to_text(),
                where,
                store,
            ),
            connect_for + 2.0,
            what=f"connecting to the store at {store}",
        )
        return cls(opened, plan, checked, seconds)

    @classmethod
    def open_sync(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        timeout: float | None = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> WeightPublisher:
        """:meth:`open` for programs without an event loop."""
        return run_sync(  # type: ignore[no-any-return]
            functools.partial(
                cls.open,
                tensors,
                store=store,
                channel=channel,
                timeout=timeout,
                bucket_bytes=bucket_bytes,
            )
        )

    def _beat(self, count: int) -> None:
        """The publisher's beat; it also says how many registrations it saw
        (``agang._weights.channel`` rule 2)."""
        self._channel.beat("publisher", count)
        registered = self._channel.registered()
        if registered != self._registered:
            self._registered = registered
            self._channel.say_seen(registered)

    @property
    def subscribers(self) -> tuple[str, ...]:
        """The names of the subscribers admitted now (the current epoch's)."""
        return tuple(m.name for m in self._members)

    @property
    def plan(self) -> Plan:
        """The fingerprinted plan (names, order, shapes, dtypes) every subscriber agreed to."""
        return self._plan

    async def push(self, version: int, timeout: float | None = None) -> PushReport:  # noqa: ASYNC109
        """One round: every admitted subscriber, and every one that opened since the last
        push, receives ``version`` in full. Never raises for a lost subscriber: it is in
        the report's ``dropped``, with why, and the others' round goes on (module rules).

        Args:
            version: An int above the last one pushed.
            timeout: The round's deadline in seconds (None: ``open``'s timeout). A
                failure adds a bounded recovery (``RECOVERY_SECONDS``, plus the bytes'
                time) after it.
        """
        if self._closed:
            raise RuntimeError("The publisher is closed.")
        if self._busy:
            raise RuntimeError("A push is under way on this publisher: await it first.")
        version = checks.check_version(version, self._last)
        seconds = checks.check_timeout(timeout)
        seconds = self._timeout if seconds is None else seconds
        started = time.monotonic()
        deadline = started + (math.inf if seconds is None else seconds)
        dropped: dict[str, str] = {}
        self._busy = True
        try:
            # A joiner that did not come took the members' time: the round then gets
            # the recovery's bound from then (rule 4), as after a failed round.
            deadline = await self._admit(version, deadline, dropped)
            delivered = await self._round_with_recovery(version, deadline, dropped)
        finally:
            self._busy = False
        self._last = version
        return PushReport(
            version=version,
            delivered=tuple(sorted(delivered - set(dropped))),
            dropped=dropped,
            seconds=time.monotonic() - started,
            bytes=self._plan.nbytes,
            epoch=max(0, self._epoch),
        )

    def push_sync(self, version: int, timeout: float | None = None) -> PushReport:
        """:meth:`push` for programs without an event loop."""
        return run_sync(functools.partial(self.push, version, timeout))  # type: ignore[no-any-return]

    # Rule 1: admission.

    async def _admit(self, version: int, deadline: float, dropped: dict[str, str]) -> float:
        """Admits the joiners (rule 1); the round's deadline, later where one did not
        come (rule 4)."""
        if self._registered == self._handled and not self._pending:
            return deadline  # nothing new since the last look: no store read, no thread
        joiners = await blocking(self._joiners, bound(deadline), what="reading the joiners")
        members = [m for m in self._members if m.uid not in self._leaving]
        for gone in [m for m in self._members if m.uid in self._leaving]:
            dropped[gone.name] = "it closed (left the channel)"
        self._leaving.clear()
        if not joiners and len(members) == len(self._members):
            return deadline
        for joiner in joiners:
            for old in [m for m in members if m.name == joiner.name]:
                members.remove(old)
                why = f"replaced: a subscriber of the same name opened ({joiner.where})"
                dropped[old.name] = why
                await blocking(functools.partial(self._drop, old.uid, why), 5.0, what="a drop")
            members.append(joiner)
        later = await self._reform(members, version, deadline, dropped)
        return deadline if later is None else later

    def _recovery_bound(self, failed_at: float) -> float:
        """When a recovery that began at ``failed_at`` must end (rule 3)."""
        return failed_at + RECOVERY_SECONDS + self._plan.nbytes / RECOVERY_BYTES_PER_SECOND

    def _joiners(self) -> list[Member]:
        """The registered subscribers, not members, whose beat is fresh; and the
        members that closed, into ``_leaving`` (blocking)."""
        self._handled = self._channel.registered()  # first: the news holds at least it
        for kind, text in self._channel.news():
            if kind == "join":
                member = Member.from_text(text)
                self._pending[member.uid] = member
                self._keeping.registered(member.uid)
            else:  # "leave"
                if self._pending.pop(text, None) is None:
                    self._leaving.add(text)
                self._keeping.left(text)
        admitted = []
        for uid, member in list(self._pending.items()):
            age = self._channel.beat_age(uid)
            if age is not None and age < channel_keys.STALE:
                admitted.append(member)
                del self._pending[uid]
            elif age is None or age > 10 * channel_keys.STALE:
                del self._pending[uid]  # gone before it was admitted
                self._keeping.left(uid)
        current = {m.uid for m in self._members}
        return [m for m in admitted if m.uid not in current]

    def _drop(self, uid: str, why: str) -> None:
        """Drops ``uid``, telling it ``why`` (blocking)."""
        alive = {*self._pending, *(m.uid for m in self._members)} - {uid}
        self._keeping.dropped(uid, why, alive)

    async def _reform(
        self, members: list[Member], version: int, deadline: float, dropped: dict[str, str]
    ) -> float | None:
        """Moves to a new epoch of ``members`` (rules 1, 4) and drops those that do not
        come. A try that failed gives the next one, and the round after, the recovery's
        bound from then, so the members that came are not dropped for the time it took:
        returns that later deadline, or None where every member came."""
        await self._leave_epoch(REFORM, version)
        lost: float | None = None
        for _ in range(len(members) + 1):  # each try drops one member at least, or ends
            self._epoch += 1
            epoch = self._epoch
            self._members = members
            self._keeping.wrote_epoch(epoch, len(members) + 1)
            if not members:
                await blocking(
                    functools.partial(self._epoch_alone, epoch), bound(deadline), what="epoch"
                )
                return lost
            came = await blocking(
                functools.partial(self._gather_check_ins, epoch, members, deadline),
                bound(deadline) + CHECK_IN_SECONDS,
                what="the check-ins",
            )
            missing = [m for m in members if m.uid not in came]
            if not missing:
                self._channel.say_go(epoch, True)
                try:
                    self._gang = await blocking(
                        functools.partial(
                            make_gang,
                            self._channel,
                            epoch,
                            0,
                            [self._me, *members],
                            bound(deadline),
                            math.inf if self._timeout is None else self._timeout,
                        ),
                        bound(deadline) + 2.0,
                        what=f"making epoch {epoch}'s group",
                    )
                    await blocking(
                        functools.partial(self._keeping.epoch_made, epoch), 5.0, what="tidying"
                    )
                    return lost
                except (GangError, RuntimeError) as error:
                    why = f"epoch {epoch}'s group could not be made: {one_line(error)}"
                    missing = [m for m in members if not self._fresh(m)] or list(members)
            else:
                self._channel.say_go(epoch, False)
                why = (
                    f"admitted to epoch {epoch} at version {version}, but did not come to "
                    f"make its group within {CHECK_IN_SECONDS:g} s (dead or stopped)"
                )
            for member in missing:
                dropped[member.name] = why
                await blocking(functools.partial(self._drop, member.uid, why), 5.0, what="a drop")
            members = [m for m in members if m not in missing]
            deadline = max(deadline, self._recovery_bound(time.monotonic()))
            lost = deadline
        self._members = []
        return lost

    def _epoch_alone(self, epoch: int) -> None:
        """``epoch`` has no subscriber: the publisher alone, and no group (blocking)."""
        self._channel.set_members(epoch, [self._me.to_text()])
        self._keeping.epoch_made(epoch)

    def _fresh(self, member: Member) -> bool:
        age = self._channel.beat_age(member.uid)
        return age is not None and age < channel_keys.STALE

    def _gather_check_ins(self, epoch: int, members: list[Member], deadline: float) -> set[str]:
        """Writes the members of ``epoch`` and waits for their check-ins (blocking)."""
        self._channel.set_members(epoch, [self._me.to_text(), *(m.to_text() for m in members)])
        give_up_at = min(deadline, time.monotonic() + CHECK_IN_SECONDS)
        wanted = {m.uid for m in members}
        while True:
            came = self._channel.checked_in(epoch) & wanted
            if came == wanted or time.monotonic() >= give_up_at:
                return came
            time.sleep(_POLL)

    async def _leave_epoch(self, what: int, version: int) -> None:
        """Tells the current gang ``what`` comes next (``REFORM``, ``CLOSE``) and closes it."""
        gang, self._gang = self._gang, None
        if gang is None:
            return
        if not gang.closed:
            self._renew_held()
            header = self._buckets.header
            header.copy_(torch.tensor([what, version, self._epoch + 1, 0]))
            with contextlib.suppress(GangError):  # a member gone: the abort told the others
                await gang.broadcast(self._buckets.wire[0], 0, timeout=5.0)
        await gang.close()

    # Rules 2, 3: the round and its recovery.

    async def _round_with_recovery(
        self, version: int, deadline: float, dropped: dict[str, str]
    ) -> set[str]:
        """The names of the subscribers that confirmed ``version`` (rule 3)."""
        delivered: set[str] = set()
        for attempt in range(2):
            if self._gang is None:
                return delivered
            acked, failure = await self._round(version, deadline)
            delivered |= {m.name for m in self._members if m.uid in acked}
            if failure is None:
                return delivered
            failed_at = time.monotonic()
            missing = [m for m in self._members if m.uid not in acked]
            answers = await blocking(
                functools.partial(self._channel.ask, [m.uid for m in missing]),
                5.0,
                what="asking the subscribers",
            )
            error = one_line(failure).rstrip(".")
            kept = list(self._members)
            for member in missing:
                answer = answers.get(member.uid)
                if answer is None or attempt == 1:
                    said = _NO_ANSWER if answer is None else f"failed twice; it says: {answer}"
                    why = f"{said}; version {version}'s round failed: {error}"
                    dropped[member.name] = why
                    await blocking(
                        functools.partial(self._drop, member.uid, why), 5.0, what="a drop"
                    )
                    kept.remove(member)
            recovery = self._recovery_bound(failed_at)
            later = await self._reform(kept, version, recovery, dropped)
            deadline = recovery if later is None else later
        return delivered

    async def _round(self, version: int, deadline: float) -> tuple[set[str], BaseException | None]:
        """Rule 2: the subscribers (uids) that confirmed ``version``, and the first failure."""
        gang = self._gang
        assert gang is not None
        self._renew_held()
        buckets = self._buckets
        header = torch.tensor([DATA, version, self._epoch, 0])
        handles = []
        failure: BaseException | None = None
        try:
            for index in range(len(buckets.wire)):
                buckets.fill(index)
                if index == 0:
                    buckets.header.copy_(header)
                handles.append(
                    gang.broadcast(buckets.wire[index], 0, timeout=bound(deadline, 0.001))
                )
            acks = [torch.zeros(2, dtype=torch.int64) for _ in self._members]
            for rank, ack in enumerate(acks, 1):
                handles.append(gang.recv(ack, rank, timeout=bound(deadline, 0.001)))
        except GangError as error:
            failure = error
            acks = []
        # The last issued first: the confirmations end last, and a handle that ended
        # before it is awaited costs no wake-up of the loop (one a push, not one an op).
        errors: dict[int, GangError] = {}
        for index in reversed(range(len(handles))):
            try:
                await handles[index]
            except GangError as error:
                errors[index] = error
        if failure is None and errors:
            # The cause: the first in issue order that was not abandoned for another's.
            causes = [e for _, e in sorted(errors.items()) if not isinstance(e, GangBrokenError)]
            failure = causes[0] if causes else errors[min(errors)]
        acked = set()
        sent = len(handles) - len(acks)
        for member, ack, handle in zip(self._members, acks, handles[sent:], strict=False):
            if (
                handle.done()
                and handle.exception() is None
                and ack.tolist() == [version, self._epoch]
            ):
                acked.add(member.uid)
        if failure is not None:
            # On a thread of its own: a close waits (up to 5 s) for ops that c10d has not
            # ended, such as a broadcast to a peer behind a dead link, and the recovery
            # must not (it took 5.3 s of a cut-off push's recovery).
            start_daemon(gang.close_sync, name=f"agang: weights: close gang '{gang.name}'")
            self._may_be_held = True  # its ops may go on holding the buckets
        return acked, failure

    def _renew_held(self) -> None:
        """A new buffer for each bucket an op of a failed round still holds (the
        buckets' rule 6), so that this round neither waits for that op nor fails. Only
        a failed round leaves such ops: a push after good ones looks at nothing."""
        if not self._may_be_held:
            return
        self._may_be_held = False
        for index, wire in enumerate(self._buckets.wire):
            if busy.is_busy(wire):
                self._buckets.renew(index)

    async def close(self) -> None:
        """Tells the subscribers that the channel closes (their ``receive`` then raises,
        saying so) and lets go of the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._leave_epoch(CLOSE, self._last or 0)
        self._stop_beat.set()
        await blocking(self._say_closed, 5.0, what="closing the channel")

    def _say_closed(self) -> None:
        self._channel.say_closed()
        self._keeping.closing()

    def close_sync(self) -> None:
        """:meth:`close` for programs without an event loop."""
        run_sync(self.close)
