"""The trainer's side: ``WeightPublisher``. A push admits (who is in each epoch:
``agang._weights.admission``'s ``Admission``, which the publisher owns), runs its round,
recovers it, and leaves what a cancel leaves; the publisher also fences the others.

Rules:
1. *Membership at round boundaries* (``agang._weights.admission`` rule 1): a push
   first admits the subscribers registered since the last one and drops the members
   that left, and where anything changed, moves the members to a new epoch; the old
   gang is told ``REFORM`` in bucket 0's header (``_leave_epoch``).
2. *A round* sends the buckets in order, each filled just before it is issued (the
   next one fills while the last one moves), then takes each subscriber's confirmation
   (its version and epoch, sent to rank 0). The whole round has the push's deadline.
3. *Recovery.* A round that fails (a deadline: the gang aborts; a lost connection)
   leaves the subscribers that confirmed delivered; the others are asked where they
   stand (``agang._weights.admission`` rule 3). Those that do not answer, or whose
   rounds still wait in the failed round's group after the publisher ended it (stalled:
   they held the others' round up), are dropped, with why; the rest move to a new epoch
   without them and the round runs again there, once, within ``RECOVERY_SECONDS``
   (plus the time the bytes take at ``RECOVERY_BYTES_PER_SECOND``; both admission's)
   after the failure; a bucket that an op of the failed round still holds
   (``Gang.holds``) moves in a new buffer (``agang._weights.buckets`` rule 6). A member
   that fails the second round too, having confirmed neither, is dropped. So a push
   returns within its deadline plus that bound, and never raises for a lost server.
4. *Check-ins are bounded* (``agang._weights.admission`` rule 2): a member that does
   not come to make a new epoch's gang is dropped, within the recovery's bound.
5. *One publisher per channel: the newest fences the others.* ``open`` takes the
   channel from a publisher that holds it, tells it (``agang._weights.channel`` rule
   1), and returns once it stopped (it says so at its next beat) or was seen silent
   for ``STALE`` (dead or stopped). From then on the old one's pushes raise
   ``GangError`` naming the new one, and it sends its servers no version. Fencing, not
   refusing: a trainer restarted while the old process lingers (or is stopped, and
   could wake) must take over without waiting for it, and the old one must fail
   clearly wherever it is; refusing would keep the new one out and still need the
   fence for the old one that wakes.
6. *Cancellation.* A push reads the trainer's tensors until it returns or raises, and
   never after. Cancelled mid-round, it lets the round's ops finish for up to
   ``CANCEL_GRACE`` seconds (they are under way, and a round takes milliseconds: a
   finished round leaves the epoch as it was), then closes the epoch's gang before the
   cancel goes on: closing aborts the ops still reading the tensors (their connections
   close, so no byte read later leaves), and the next push starts a new epoch with the
   same members. A server then holds the cancelled version whole or not at all
   (staging; in place, its tensors may hold parts of it until the next version
   comes). Cancelled while it admitted subscribers, the next push admits them: an
   epoch whose go was said has its gang made, and then closed, by the thread that said
   it, since its members wait in that gang's rendezvous (``agang._weights.admission``
   rule 4).
7. *The store.* A push needs the store only where the membership changes or a round
   fails; where the store failed or did not answer, the push raises ``GangError``
   naming it, within its deadline and the recovery bound. The fleet connects again
   (and opens the session there again, on a store that was restarted), so a later
   push goes on once a store is back.
8. *Death notices* (``agang.report_death``): a member a watcher reports dead is dropped
   with the watcher's why, not asked; a round under way when the notice comes is ended
   at once, and the push's recovery runs the round again without it.
9. *A sharded trainer* (``open(..., gang=)``): every rank of the trainer's gang opens
   and pushes; rank 0 is the channel's publisher, and gathers each bucket from the
   ranks' shares over a lane of the gang while the bucket before moves to the fleet
   (``agang._weights.gathering``); the others send their shares and take the push's
   report from rank 0 (``agang._weights.following``), so every rank returns the same
   report or raises the same error. A rank's shares that do not come end the push on
   every rank, with the lane's blame: rank 0 closes the round's gang before the last
   bucket, so no server takes a part of that version, and the next push (over a gang
   re-formed, by a publisher opened again) goes on with the same servers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import anyio
import torch

from agang._errors import GangBrokenError, GangError, GangInitError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._membership import deaths
from agang._membership.gangs import GangFactory
from agang._membership.member import Member
from agang._runtime.threads import run_blocking, start_daemon
from agang._weights import checks, over_gang
from agang._weights.admission import Admission
from agang._weights.blocking import STEP_SECONDS, blocking, bound, run_sync
from agang._weights.buckets import Buckets, header_of
from agang._weights.channel import Channel
from agang._weights.epoch import CLOSE, DATA, REFORM
from agang._weights.fleet import Fleet
from agang._weights.following import Following
from agang._weights.gathering import Gathering
from agang._weights.housekeeping import Housekeeping
from agang._weights.plan import DEFAULT_BUCKET_BYTES, GANG_BUCKET_BYTES, Plan
from agang._weights.report import PushReport
from agang._weights.sharding import Layout
from agang._weights.site import Site

log = logging.getLogger("agang.weights")
T = TypeVar("T")

#: How long a push cancelled mid-round lets the round's ops finish before it closes the
#: round's gang (rule 6): a round that ends costs nothing, an abort a new epoch.
CANCEL_GRACE = 1.0
#: The longest ``open`` waits for the connection to the store where it has no deadline.
OPEN_SECONDS = 60.0


class WeightPublisher:
    """Pushes a ``state_dict``'s values to the subscribers of a channel, whoever they
    are at each push. Open it with [`open`][agang.WeightPublisher.open].

    Example:
        <!-- not-run: needs an agang store and subscribers on other machines -->
        ```python
        publisher = await agang.WeightPublisher.open(model.state_dict(),
            store="10.0.0.1:29500", channel="policy")
        report = await publisher.push(step)
        ```
    """

    def __init__(
        self,
        channel: Channel,
        plan: Plan,
        tensors: dict[str, torch.Tensor],
        timeout: float | None,
        factory: GangFactory,
        me: Member,
        connect: Callable[[float], Any],
        gathering: Gathering | None = None,
    ) -> None:
        self._channel = channel
        self._plan = plan
        # The buckets: the tensors', or, over a trainer gang, gathered (rule 9).
        self._gathering = gathering
        self._buckets = None if gathering else Buckets(plan, tensors, publisher=True, in_place=True)
        self._following: Following | None = None  # a trainer gang's rank > 0 (rule 9)
        self._timeout = timeout  # a push's default deadline (None: none)
        self._me = me
        self._connect = connect  # a new client of the store, by a deadline
        self._abandoned: list[Gang] = []  # failed epochs' gangs, whose ops may hold buckets
        self._in_flight: list[Handle[Any]] = []  # the round under way's ops (rule 6)
        self._in_round = False  # a round is under way, its ops issued or not (rule 8)
        self._keeping = Housekeeping(channel, factory.rendezvous_keys)
        self._last: int | None = None
        self._busy = False
        self._closed = False
        self._fleet = Fleet(channel, self._keeping, self._reconnect, self._member_died)
        # The members, epoch and gang (rules 1, 4): the fleet's thread reads them only
        # where the store failed at a beat (``_reconnect``), so not before this line.
        self._admission = Admission(
            channel,
            self._fleet,
            self._keeping,
            factory,
            me,
            timeout,
            plan.nbytes,
            functools.partial(self._leave_epoch, REFORM),
            aborts_seen=plan.transport == "gloo",
        )
        # Death notices (rule 8) come to a mailbox of the publisher's own.
        self._listening = deaths.Listening(
            channel.store, f"{channel.prefix}/pub", 0, self._fleet.heard
        )

    @classmethod
    async def open(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        timeout: float | None = 60.0,  # noqa: ASYNC109  # the default deadline of open and push
        bucket_bytes: int | None = None,
        secret: str | bytes | None = None,
        gang: Gang | None = None,
    ) -> WeightPublisher:
        """Opens ``channel`` on the ``agang store`` at ``store`` ("HOST:PORT") and writes
        the plan of ``tensors`` there; subscribers may open before or after. A publisher
        that holds the channel already is fenced (module rule 5): its pushes raise from
        then on, and ``open`` returns once it stopped, or was seen silent.

        Args:
            tensors: Names to contiguous CPU tensors (a ``state_dict()``; a tensor under
                several names moves once): what each push sends, read during the push
                and only then (do not write them while a push is awaited). With
                ``gang``, each rank's: ``DTensor``s (``Shard(d)`` or ``Replicate()`` on
                a 1-D mesh of the gang's ranks, as FSDP2 holds them), ``agang.Sharded``
                and plain tensors (taken from rank 0).
            store: The store's "HOST:PORT".
            channel: The channel's name; subscribers name the same.
            timeout: The deadline of ``open`` and each push's default one (seconds; None
                or ``math.inf``: pushes have none, and ``open`` waits up to 60 s).
            bucket_bytes: The most bytes of small tensors packed into one broadcast
                (with ``gang``, also of a larger tensor's, cut between rows); None:
                4 MiB, or 16 MiB with ``gang``, where each bucket costs a gather too.
            secret: The channel's secret, if it has one: the same on every side. It
                authenticates the channel's control records in the store, so that a
                stranger who reaches the store cannot publish or strand a server
                (``docs/guides/trust.md`` says what it does not protect).
            gang: A sharded trainer's gang (module rule 9): every rank opens, and then
                pushes, together; rank 0 sends to the fleet, gathering each bucket
                from the ranks' shards. ``open`` and ``push`` are collective calls.

        Raises:
            GangInitError: The store did not answer before the deadline.
            ValueError: An argument is invalid (the message names it; with ``gang``,
                on every rank, naming the rank whose inputs were refused).
        """
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES if gang is None else GANG_BUCKET_BYTES
        if gang is not None:  # every check on every rank, agreed (rule 9)
            return await cls._open_over(
                over_gang.check_gang(gang), tensors, store, channel, timeout, bucket_bytes, secret
            )
        host, port = checks.check_store(store)
        name = checks.check_channel(channel)
        seconds = checks.check_deadline(timeout)
        key = checks.check_secret(secret)
        checked = checks.check_tensors(tensors)
        site = Site.of(store, host, port, name, "weights publisher", checks.device_of(checked))
        plan = Plan.of(checked, bucket_bytes, site.transport)
        return await cls._open(checked, plan, name, seconds, key, site)

    @classmethod
    async def _open(
        cls,
        tensors: dict[str, torch.Tensor],
        plan: Plan,
        channel: str,
        seconds: float | None,
        secret: bytes | None,
        site: Site,
        gathering: Gathering | None = None,
    ) -> WeightPublisher:
        """``open`` past its checks, on ``site`` (agang's tests give one of their own)."""
        me = Member.me("publisher")
        open_for = OPEN_SECONDS if seconds is None else seconds
        deadline = time.monotonic() + open_for

        def start() -> tuple[Channel, str | None]:
            client = site.connect(deadline)
            return Channel.start(client, channel, plan.to_text(), me.where, site.address, secret)

        opened, previous = await blocking(
            start, open_for + 2.0, what=f"connecting to the store at {site.address}",
            store=site.address,
        )  # fmt: skip
        if previous is not None:
            await blocking(
                functools.partial(opened.other(previous).fence_and_wait, me.where, deadline),
                open_for + 2.0,
                what="fencing the channel's last publisher",
                store=site.address,
            )
        return cls(opened, plan, tensors, seconds, site.factory, me, site.connect, gathering)

    @classmethod
    async def _open_over(
        cls,
        gang: Gang,
        tensors: object,
        store: object,
        channel: object,
        timeout: object,  # noqa: ASYNC109  # open's, checked here
        bucket_bytes: int,
        secret: object,
        site_of: Callable[[torch.device], Site] | None = None,
    ) -> WeightPublisher:
        """``open`` over a trainer gang (rule 9; ``agang._weights.over_gang``): every
        rank checks its inputs and the ranks agree, then rank 0 opens the channel and
        the others follow it; ``site_of`` gives the channel's site (agang's tests)."""
        refused: str | None = None
        layouts: list[Layout] = []
        plan: Plan | None = None
        site: Site | None = None
        name, seconds, key = str(channel), None, None
        try:
            given = over_gang.check_inputs(
                gang, tensors, store, channel, timeout, secret, "weights publisher", site_of
            )
            name, seconds, key, site = given.channel, given.seconds, given.key, given.site
            layouts = given.layouts
            plan = over_gang.plan_of(list(given.local), layouts, bucket_bytes, site.transport)
        except (TypeError, ValueError) as error:
            refused = str(error)
        open_for = OPEN_SECONDS if seconds is None else seconds
        what = f"the weights channel '{name}'"
        (lane,) = await over_gang.lanes(gang, name, 1, open_for, what)
        plan = await over_gang.agree(lane, refused, plan, layouts, open_for)
        assert plan is not None
        assert site is not None
        said: list[Any] = [None]
        if gang.rank != 0:
            await lane.broadcast_objects(said, 0, timeout=over_gang.following_bound(seconds))
            if said[0] is not None:
                raise GangInitError(f"Trainer rank 0 could not open the channel: {said[0]}")
            return cls._follower(Following(plan, layouts, lane, name), seconds)
        try:
            opened = await cls._open(
                {}, plan, name, seconds, key, site, Gathering(plan, layouts, lane)
            )
        except BaseException as error:
            with anyio.CancelScope(shield=True), contextlib.suppress(GangError):
                said[0] = one_line(error) or type(error).__name__
                await lane.broadcast_objects(said, 0, timeout=5.0)
            raise
        try:
            await lane.broadcast_objects(said, 0, timeout=seconds)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await opened.close()
            raise
        return opened

    @classmethod
    def _follower(cls, following: Following, seconds: float | None) -> WeightPublisher:
        """The publisher of a trainer gang's rank > 0 (rule 9): its pushes follow rank 0's."""
        made = cls.__new__(cls)
        made._following = following
        made._plan = following.plan
        made._timeout = seconds
        made._last = None
        made._busy = False
        made._closed = False
        return made

    @classmethod
    def open_sync(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        timeout: float | None = 60.0,
        bucket_bytes: int | None = None,
        secret: str | bytes | None = None,
        gang: Gang | None = None,
    ) -> WeightPublisher:
        """[`open`][agang.WeightPublisher.open] for programs without an event loop."""
        return run_sync(  # type: ignore[no-any-return]
            functools.partial(
                cls.open,
                tensors,
                store=store,
                channel=channel,
                timeout=timeout,
                bucket_bytes=bucket_bytes,
                secret=secret,
                gang=gang,
            )
        )

    @property
    def subscribers(self) -> tuple[str, ...]:
        """The names of the subscribers admitted now (the current epoch's; on a trainer
        gang's rank > 0, those the last push delivered to)."""
        if self._following is not None:
            last = self._following.last
            return () if last is None else last.delivered
        return tuple(m.name for m in self._admission.members)

    @property
    def plan(self) -> Plan:
        """The fingerprinted plan (names, order, shapes, dtypes) every subscriber agreed to."""
        return self._plan

    async def push(self, version: int, timeout: float | None = None) -> PushReport:  # noqa: ASYNC109
        """One round: every admitted subscriber, and every one that opened since the last
        push, receives ``version`` in full. Never raises for a lost subscriber: it is in
        the report's ``dropped``, with why, and the others' round goes on (module rules).

        The push reads the tensors until it returns or raises, and never after: do not
        write them meanwhile. Cancelled, it closes its round first (module rule 6): a
        subscriber holds that version whole or not at all, and the next push goes on.

        Args:
            version: An int above the last one pushed (below 2**63).
            timeout: The round's deadline in seconds (None: ``open``'s timeout;
                ``math.inf``: none). A failure adds a bounded recovery
                (``RECOVERY_SECONDS``, plus the bytes' time) after it.

        Raises:
            GangError: Another publisher opened the channel since (module rule 5), or
                the store failed or did not answer where the push needed it (rule 7);
                over a trainer gang, a rank's shares did not come (rule 9: on every
                rank, with the lost rank's blame).
        """
        if self._closed:
            raise RuntimeError("The publisher is closed.")
        if self._busy:
            raise RuntimeError("A push is under way on this publisher: await it first.")
        if self._following is not None:  # rank 0 judges the version (rule 9)
            version = checks.check_version(version, None)
        elif self._gathering is not None:
            try:
                checks.check_version(version, self._last)
            except (TypeError, ValueError) as error:  # the other ranks raise it too
                with anyio.CancelScope(shield=True):
                    said = version if type(version) is int else None
                    await self._gathering.abandon(f"rank 0 refused it: {error}", said)
                raise
        version = checks.check_version(version, self._last)
        seconds = checks.check_deadline(timeout, default=self._timeout)
        self._busy = True
        try:
            report = await self._push(version, seconds)
        finally:
            self._busy = False
        self._last = version
        return report

    async def _push(self, version: int, seconds: float | None) -> PushReport:
        """``push`` past its checks (rules 1-3, 6, 9)."""
        if self._following is not None:
            return await self._following.push(version, seconds)
        gathering = self._gathering
        started = time.monotonic()
        deadline = started + (math.inf if seconds is None else seconds)
        try:
            if gathering is not None and gathering.broken is not None:
                raise GangError(
                    f"Channel '{self._channel.name}': this publisher (trainer rank 0) can "
                    f"push no more: the lane to the other trainer ranks is out of step "
                    f"({gathering.broken}). Open a publisher again (over the gang "
                    f"re-formed, where it lost a rank)."
                )
            self._raise_if_fenced()
            deadline = await self._admission.admit(version, deadline)
            delivered = await self._round_with_recovery(version, deadline)
        except BaseException as error:
            with anyio.CancelScope(shield=True):
                await self._abandon()
                if gathering is not None:
                    cancelled = isinstance(error, anyio.get_cancelled_exc_class())
                    why = "it was cancelled on rank 0" if cancelled else one_line(error)
                    await gathering.abandon(why, version)
            raise
        report = PushReport(
            version=version,
            delivered=self._admission.names_of(delivered),
            dropped=self._admission.take_dropped(),
            seconds=time.monotonic() - started,
            bytes=self._plan.nbytes,
            epoch=max(0, self._admission.epoch),
        )
        if gathering is not None:
            try:
                await gathering.end({"version": version, "report": dataclasses.asdict(report)})
            except GangError as error:  # the fleet holds the version: said, not raised
                log.warning(
                    "agang: channel '%s': the push's report did not reach the "
                    "other trainer ranks: %s",
                    self._channel.name,
                    one_line(error),
                )
        return report

    def push_sync(self, version: int, timeout: float | None = None) -> PushReport:
        """[`push`][agang.WeightPublisher.push] for programs without an event loop."""
        return run_sync(functools.partial(self.push, version, timeout))  # type: ignore[no-any-return]

    def _raise_if_fenced(self) -> None:
        fenced = self._fleet.fenced_by
        if fenced is not None:
            raise GangError(
                f"Publisher ({self._me.where}) of channel '{self._channel.name}' can push "
                f"no more: another publisher opened the channel ({fenced}) and fenced this "
                f"one (a channel has one publisher: the newest)."
            )

    async def _abandon(self) -> None:
        """What a push cancelled or failed mid-way leaves (rule 6): its round finished
        within ``CANCEL_GRACE``, or its gang closed (no op of it reads the tensors after
        the push raised) and the next push to start a new epoch; the joiners it took
        given back. Called shielded from the cancel."""
        self._admission.give_back()
        in_flight, self._in_flight = self._in_flight, []
        if in_flight and self._admission.gang is not None:
            with anyio.move_on_after(CANCEL_GRACE):
                for handle in in_flight:
                    with contextlib.suppress(GangError):
                        await handle
            if all(h.done() and h.exception() is None for h in in_flight):
                return  # the round ended well: the epoch goes on
        gang = self._admission.take_gang()
        if gang is not None:
            self._abandoned.append(gang)
            await gang.close()

    def _member_died(self) -> None:
        """A death notice named a member (rule 8), on the listener's thread: a round
        under way, which waits on it, is ended now (its gang closed on a thread), so
        that the push drops it and goes on with the others without its deadline. Under
        way from its first bucket on: a gathering round (rule 9) waits for a bucket's
        broadcast before it issues the next, so its ops are not all in flight yet."""
        gang = self._admission.gang
        if gang is not None and (self._in_flight or self._in_round):
            start_daemon(gang.close_sync, name=f"agang: weights: end round of '{gang.name}'")

    def _blocking(self, fn: Callable[[], Any], seconds: float, what: str) -> Any:
        return blocking(fn, seconds, what=what, store=self._channel.address)

    def _reconnect(self) -> None:
        """A new connection to the store, for the fleet (``agang._weights.fleet`` rule 4);
        where the store lost the session (it was restarted), it is opened there again,
        with the current epoch's members, unless another publisher took the channel."""
        channel = self._channel
        channel.rebind(self._connect(time.monotonic() + 2.0))
        if channel.plan_text() is not None:
            return
        holder = channel.take(self._plan.to_text(), self._me.where, if_free=True)
        if holder is not None:  # another publisher opened the channel on the new store
            self._fleet.fenced_by = channel.other(holder).publisher()
            return
        self._admission.write_members_again()
        log.info(
            "agang: the store at %s had lost channel '%s': opened again there.",
            channel.address,
            channel.name,
        )

    # Rules 1, 6: leaving an epoch.

    async def _leave_epoch(self, what: int, version: int) -> None:
        """Tells the current gang ``what`` comes next (``REFORM``, ``CLOSE``) and closes it."""
        gang = self._admission.take_gang()
        if gang is None:
            return
        self._renew_held()
        self._abandoned.append(gang)  # cancelled mid-broadcast, its op may hold bucket 0
        try:
            if not gang.closed:
                self._header().copy_(torch.tensor([what, version, self._admission.epoch + 1, 0]))
                with contextlib.suppress(GangError):  # a member gone: the abort told them
                    await gang.broadcast(self._bucket0(), 0, timeout=5.0)
        finally:
            with anyio.CancelScope(shield=True):  # cancelled or not, the gang is closed
                await gang.close()

    # Rules 2, 3: the round and its recovery.

    async def _round_with_recovery(self, version: int, deadline: float) -> set[str]:
        """The uids of the subscribers that confirmed ``version`` (rule 3)."""
        delivered: set[str] = set()
        for attempt in range(2):
            if self._admission.gang is None:
                return delivered
            acked, failure = await self._round(version, deadline)
            delivered |= acked
            if failure is None:
                return delivered
            deadline = await self._admission.recover(version, delivered, failure, last=attempt == 1)
        return delivered

    async def _round(self, version: int, deadline: float) -> tuple[set[str], BaseException | None]:
        """Rule 2: the subscribers (uids) that confirmed ``version``, and the first failure."""
        self._in_round = True  # a death notice ends it from now on (rule 8)
        try:
            return await self._round_under_way(version, deadline)
        finally:
            self._in_round = False

    async def _round_under_way(
        self, version: int, deadline: float
    ) -> tuple[set[str], BaseException | None]:
        """``_round``'s body."""
        gang = self._admission.gang
        assert gang is not None
        members, epoch = self._admission.members, self._admission.epoch
        gathering, buckets = self._gathering, self._buckets
        if gathering is not None:
            # The round's word first: the other trainer ranks wake to it while this one
            # readies the round (it posts no receive: the buffers may still be renewed).
            await self._trainer_step(gang, version, gathering.begin(version, deadline))
        if self._fleet.any_dead(members):
            # A notice heard after this push's sighting, before the round was under way:
            # ``_member_died`` found none to end then, so this round ends here (rule 8).
            self._member_died()
        self._renew_held()
        # Once, before bucket 0 is filled or gathered: neither writes its header bytes.
        self._header().copy_(torch.tensor([DATA, version, epoch, 0]))
        handles: list[Handle[Any]] = []
        failure: BaseException | None = None
        count = len(buckets.wire) if buckets is not None else gathering.count if gathering else 0
        for index in range(count):
            if buckets is not None:
                buckets.fill(index)
                wire = buckets.wire[index]
            else:  # rule 9: gathered while the bucket before moves
                assert gathering is not None
                user = gathering.slot_user(index)
                before = handles[user] if user is not None and user < len(handles) else None
                wire = await self._trainer_step(
                    gang, version, gathering.take(index, deadline, before)
                )
            if failure is None:
                try:
                    handles.append(gang.broadcast(wire, 0, timeout=bound(deadline, 0.001)))
                except GangError as error:
                    failure = error
                    if gathering is None:  # a gathering round still takes its shares
                        break
        acks: list[torch.Tensor] = []
        try:
            if failure is None:
                # On the gang's device (NCCL takes no other): bucket 0's.
                acks = [torch.zeros_like(self._header()[:2]) for _ in members]
                for rank, ack in enumerate(acks, 1):
                    handles.append(gang.recv(ack, rank, timeout=bound(deadline, 0.001)))
        except GangError as error:
            failure = error
            acks = []
        # The last issued first: the confirmations end last, and a handle that ended
        # before it is awaited costs no wake-up of the loop (one a push, not one an op).
        # Cancelled here, the push's abandon lets them end, or closes the gang (rule 6).
        self._in_flight = handles
        errors: dict[int, GangError] = {}
        for index in reversed(range(len(handles))):
            try:
                await handles[index]
            except GangError as error:
                errors[index] = error
        self._in_flight = []
        if failure is None and errors:
            # The cause: the first in issue order that was not abandoned for another's.
            causes = [e for _, e in sorted(errors.items()) if not isinstance(e, GangBrokenError)]
            failure = causes[0] if causes else errors[min(errors)]
        acked = set()
        sent = len(handles) - len(acks)
        for member, ack, handle in zip(members, acks, handles[sent:], strict=False):
            if handle.done() and handle.exception() is None and ack.tolist() == [version, epoch]:
                acked.add(member.uid)
        if failure is not None:
            # On a thread of its own: a close waits (up to 5 s) for ops that c10d has not
            # ended, such as a broadcast to a peer behind a dead link, and the recovery
            # must not (it took 5.3 s of a cut-off push's recovery).
            self._admission.take_gang()  # the next push reforms
            self._abandoned.append(gang)
            start_daemon(gang.close_sync, name=f"agang: weights: close gang '{gang.name}'")
        return acked, failure

    async def _trainer_step(self, gang: Gang, version: int, step: Awaitable[T]) -> T:
        """A step of the lane to the other trainer ranks (rule 9); where it fails, a
        trainer rank's shares will not come: the round's gang is closed before any
        server holds the version, and the push raises."""
        try:
            return await step
        except GangError as error:
            self._admission.take_gang()  # the next push reforms, with the same members
            self._abandoned.append(gang)
            start_daemon(gang.close_sync, name=f"agang: weights: close gang '{gang.name}'")
            raise GangError(
                f"Channel '{self._channel.name}': the push of version {version} failed and "
                f"no server took it: a trainer rank's shares of the weights did not come: "
                f"{one_line(error)}"
            ) from error

    def _header(self) -> torch.Tensor:
        """The round's header, at the start of bucket 0 (``agang._weights.buckets`` rule 3)."""
        return header_of(self._bucket0())

    def _bucket0(self) -> torch.Tensor:
        if self._gathering is not None:
            return self._gathering.bucket0
        assert self._buckets is not None
        return self._buckets.wire[0]

    def _renew_held(self) -> None:
        """A new buffer for each bucket an op of a failed or abandoned round still holds
        (``Gang.holds``; the buckets' rule 6), so that this round neither waits for that
        op nor fails. Only such rounds leave ops behind: a push after good ones looks at
        nothing. The new buffers are this round's alone: the old gangs never see them."""
        if not self._abandoned:
            return
        if self._gathering is not None:
            self._gathering.renew_held(self._abandoned)
        elif self._buckets is not None:
            for index, wire in enumerate(self._buckets.wire):
                if any(gang.holds(wire) for gang in self._abandoned):
                    self._buckets.renew(index)
        self._abandoned.clear()

    async def close(self) -> None:
        """Tells the subscribers that the channel closes (their ``receive`` then raises,
        saying so) and lets go of the store. Idempotent; a store that is gone does not
        make it fail (it is logged)."""
        if self._closed:
            return
        self._closed = True
        if self._following is not None:  # rank 0 holds the channel (rule 9)
            await self._following.close()
            return
        with anyio.CancelScope(shield=True):
            if self._gathering is not None:  # the other ranks told (rule 9)
                await self._gathering.close("the publisher on trainer rank 0 was closed")
            await self._leave_epoch(CLOSE, self._last or 0)
            self._fleet.stop()
            await run_blocking(self._listening.stop, name="weights: stop listening", seconds=5.0)
            if self._fleet.fenced_by is not None:
                return  # the channel is another's: its keys are not this one's to tidy
            try:
                await self._blocking(self._say_closed, STEP_SECONDS, "closing the channel")
            except GangError as error:
                log.info("agang: closing channel '%s': %s", self._channel.name, error)

    def _say_closed(self) -> None:
        self._channel.say_closed("closed")
        self._keeping.closing()

    def close_sync(self) -> None:
        """[`close`][agang.WeightPublisher.close] for programs without an event loop."""
        run_sync(self.close)
