"""The trainer's side: ``WeightPublisher``. Why one module of this size: the push is
one protocol (admission, the round, its recovery, and what a cancel leaves), whose steps
share the publisher's state; split, each half would read the other's fields.

Rules:
1. *Membership at round boundaries.* A push first takes what the fleet saw since the
   last one (``agang._weights.fleet``, no store op): the subscribers registered since,
   the members that closed, were seen silent, or were replaced (a joiner with the name
   of a member replaces it: a restarted server). Where anything changed, the members
   move to a new epoch: the old gang is told ``REFORM`` in bucket 0's header, the new
   members are written, every one checks in, then all make the new gang (the channel's
   factory, ``agang._membership.gangs``).
2. *A round* sends the buckets in order, each filled just before it is issued (the
   next one fills while the last one moves), then takes each subscriber's confirmation
   (its version and epoch, sent to rank 0). The whole round has the push's deadline.
3. *Recovery.* A round that fails (a deadline: the gang aborts; a lost connection)
   leaves the subscribers that confirmed delivered; the others are asked where they
   stand (blame, ``agang._weights.channel`` rule 5). Those that do not answer are
   dropped, with why; the rest move to a new epoch without them and the round runs
   again there, once, within ``RECOVERY_SECONDS`` (plus the time the bytes take at
   ``RECOVERY_BYTES_PER_SECOND``) after the failure; a bucket that an op of the failed
   round still holds (``Gang.holds``) moves in a new buffer (``agang._weights.buckets``
   rule 6). A member that fails the second round too is dropped. So a push returns
   within its deadline plus that bound, and never raises for a lost server.
4. A member that does not come to make a new epoch's gang within ``CHECK_IN_SECONDS``
   is dropped, and the epoch after is made without it, within the recovery's bound
   from then; a joiner that did not come gives the round that follows that bound too,
   so that the members are not dropped for the time it took. Every step is bounded.
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
   it, since its members wait in that gang's rendezvous (``_go_and_make``).
7. *The store.* A push needs the store only where the membership changes or a round
   fails; where the store failed or did not answer, the push raises ``GangError``
   naming it, within its deadline and the recovery bound. The fleet connects again
   (and opens the session there again, on a store that was restarted), so a later
   push goes on once a store is back.
8. *Death notices* (``agang.report_death``): a member a watcher reports dead is dropped
   with the watcher's why, not asked; a round under way when the notice comes is ended
   at once, and the push's recovery runs the round again without it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch

from agang._errors import GangBrokenError, GangError, one_line
from agang._gang import Gang
from agang._handle import Handle
from agang._membership import deaths
from agang._membership.gangs import GangFactory
from agang._membership.member import Member
from agang._runtime.threads import run_blocking, start_daemon
from agang._weights import checks
from agang._weights.blocking import StoreTrouble, blocking, bound, run_sync, store_trouble
from agang._weights.buckets import Buckets
from agang._weights.channel import Channel
from agang._weights.epoch import CLOSE, DATA, REFORM, gang_name
from agang._weights.fleet import Fleet
from agang._weights.housekeeping import Housekeeping
from agang._weights.plan import DEFAULT_BUCKET_BYTES, Plan
from agang._weights.report import PushReport
from agang._weights.site import Site

log = logging.getLogger("agang.weights")

#: The recovery's bound after a failure (plus the bytes' time): a push that lost a
#: subscriber returns at most this long after its failure (measured in the tests, under
#: load: 0.35-0.42 s after a kill, 0.37-0.39 s past the deadline after a stop). A
#: survivor closes the failed epoch's gang on a thread of its own, so that close, which
#: can take seconds, is not in it.
RECOVERY_SECONDS = 2.0
RECOVERY_BYTES_PER_SECOND = 200e6
CHECK_IN_SECONDS = 2.0
#: How long a push cancelled mid-round lets the round's ops finish before it closes the
#: round's gang (rule 6): a round that ends costs nothing, an abort a new epoch.
CANCEL_GRACE = 1.0
#: The longest ``open`` waits for the connection to the store where it has no deadline.
OPEN_SECONDS = 60.0
#: The longest a store step of a push may take past the push's own bound.
_STEP_SECONDS = 5.0
_POLL = 0.01
_NO_ANSWER = "no answer (dead, stopped, or cut off from the store)"


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
    ) -> None:
        self._channel = channel
        self._plan = plan
        self._buckets = Buckets(plan, tensors, publisher=True, in_place=True)
        self._timeout = timeout  # a push's default deadline (None: none)
        self._factory = factory
        self._me = me
        self._connect = connect  # a new client of the store, by a deadline
        self._members: list[Member] = []  # the current epoch's subscribers, by rank - 1
        self._gang: Gang | None = None  # None with members: the next push reforms
        self._abandoned: list[Gang] = []  # failed epochs' gangs, whose ops may hold buckets
        self._in_flight: list[Handle[Any]] = []  # the round under way's ops (rule 6)
        self._epoch = -1
        self._taken: list[Member] = []  # joiners taken from the fleet, not admitted yet
        self._unreported: dict[str, str] = {}  # drops no report has named yet
        self._names: dict[str, str] = {}  # uid -> name, of every member of this push
        self._keeping = Housekeeping(channel, factory.rendezvous_keys)
        self._last: int | None = None
        self._busy = False
        self._closed = False
        self._fleet = Fleet(channel, self._keeping, self._reconnect, self._member_died)
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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        secret: str | bytes | None = None,
    ) -> WeightPublisher:
        """Opens ``channel`` on the ``agang store`` at ``store`` ("HOST:PORT") and writes
        the plan of ``tensors`` there; subscribers may open before or after. A publisher
        that holds the channel already is fenced (module rule 5): its pushes raise from
        then on, and ``open`` returns once it stopped, or was seen silent.

        Args:
            tensors: Names to contiguous CPU tensors (a ``state_dict()``; a tensor under
                several names moves once): what each push sends, read during the push
                and only then (do not write them while a push is awaited).
            store: The store's "HOST:PORT".
            channel: The channel's name; subscribers name the same.
            timeout: The deadline of ``open`` and each push's default one (seconds; None
                or ``math.inf``: pushes have none, and ``open`` waits up to 60 s).
            bucket_bytes: The most bytes of small tensors packed into one broadcast.
            secret: The channel's secret, if it has one: the same on every side. It
                authenticates the channel's control records in the store, so that a
                stranger who reaches the store cannot publish or strand a server
                (``docs/guides/trust.md`` says what it does not protect).

        Raises:
            GangInitError: The store did not answer before the deadline.
            ValueError: An argument is invalid (the message names it).
        """
        checked = checks.check_tensors(tensors)
        host, port = checks.check_store(store)
        name = checks.check_channel(channel)
        seconds = checks.check_deadline(timeout)
        key = checks.check_secret(secret)
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
        return cls(opened, plan, tensors, seconds, site.factory, me, site.connect)

    @classmethod
    def open_sync(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        timeout: float | None = 60.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        secret: str | bytes | None = None,
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
            )
        )

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
                the store failed or did not answer where the push needed it (rule 7).
        """
        if self._closed:
            raise RuntimeError("The publisher is closed.")
        if self._busy:
            raise RuntimeError("A push is under way on this publisher: await it first.")
        version = checks.check_version(version, self._last)
        seconds = checks.check_deadline(timeout, default=self._timeout)
        self._raise_if_fenced()
        started = time.monotonic()
        deadline = started + (math.inf if seconds is None else seconds)
        self._busy = True
        try:
            deadline = await self._admit(version, deadline)
            delivered = await self._round_with_recovery(version, deadline)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._abandon()
            raise
        finally:
            self._busy = False
        self._last = version
        dropped, self._unreported = self._unreported, {}
        return PushReport(
            version=version,
            delivered=tuple(sorted({self._names[uid] for uid in delivered})),
            dropped=dropped,
            seconds=time.monotonic() - started,
            bytes=self._plan.nbytes,
            epoch=max(0, self._epoch),
        )

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
        self._fleet.put_back(self._taken)
        self._taken = []
        in_flight, self._in_flight = self._in_flight, []
        if in_flight and self._gang is not None:
            with anyio.move_on_after(CANCEL_GRACE):
                for handle in in_flight:
                    with contextlib.suppress(GangError):
                        await handle
            if all(h.done() and h.exception() is None for h in in_flight):
                return  # the round ended well: the epoch goes on
        gang, self._gang = self._gang, None
        if gang is not None:
            self._abandoned.append(gang)
            await gang.close()

    def _member_died(self) -> None:
        """A death notice named a member (rule 8), on the listener's thread: a round
        under way, which waits on it, is ended now (its gang closed on a thread), so
        that the push drops it and goes on with the others without its deadline."""
        gang = self._gang
        if gang is not None and self._in_flight:
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
        if self._epoch >= 0:
            channel.set_members(self._epoch, [self._me, *self._members])
        log.info(
            "agang: the store at %s had lost channel '%s': opened again there.",
            channel.address,
            channel.name,
        )

    # Rule 1: admission.

    async def _admit(self, version: int, deadline: float) -> float:
        """Admits the joiners, drops who left, went silent or was replaced (rule 1);
        returns the round's deadline, later where a joiner did not come (rule 4)."""
        seen = self._fleet.take()
        self._unreported.update(seen.dropped)
        self._taken += seen.joiners
        gone: dict[str, str] = {}  # uid -> why, told to each
        for member in self._members:
            if member.uid in seen.dead:  # rule 8
                self._unreported[member.name] = seen.dead[member.uid]
                gone[member.uid] = seen.dead[member.uid]
            elif member.uid in seen.leaving:
                self._unreported[member.name] = "it closed (left the channel)"
                gone[member.uid] = ""
            elif member.uid in seen.silent:
                why = (
                    f"no beat for {seen.silent[member.uid]:.1f} s (dead, stopped, or cut "
                    f"off from the store)"
                )
                self._unreported[member.name] = why
                gone[member.uid] = why
        for joiner in self._taken:
            for old in self._members:
                if old.name == joiner.name and old.uid not in gone and old.uid != joiner.uid:
                    why = f"replaced: a subscriber of the same name opened ({joiner.where})"
                    self._unreported[old.name] = why
                    gone[old.uid] = why
        members = [m for m in self._members if m.uid not in gone]
        changed = bool(gone) or bool(self._taken) or (self._gang is None and bool(members))
        self._members = members  # the state is whole at every await below (rule 6)
        if gone:
            self._fleet.set_members(members)
            told = {uid: why for uid, why in gone.items() if why}
            if told:
                await self._blocking(
                    functools.partial(self._drop_all, told), _STEP_SECONDS, "drops"
                )
        if not changed:
            return deadline
        joiners = [j for j in self._taken if j.uid not in {m.uid for m in members}]
        later = await self._reform([*members, *joiners], version, deadline)
        self._taken = []
        return deadline if later is None else later

    def _recovery_bound(self, failed_at: float) -> float:
        """When a recovery that began at ``failed_at`` must end (rule 3)."""
        return failed_at + RECOVERY_SECONDS + self._plan.nbytes / RECOVERY_BYTES_PER_SECOND

    def _drop_all(self, why_of: dict[str, str]) -> None:
        """Drops each uid of ``why_of``, telling it why (blocking)."""
        alive = self._fleet.alive() - set(why_of)
        for uid, why in why_of.items():
            self._keeping.dropped(uid, why, alive)

    async def _reform(self, members: list[Member], version: int, deadline: float) -> float | None:
        """Moves to a new epoch of ``members`` (rules 1, 4) and drops those that do not
        come. A try that failed gives the next one, and the round after, the recovery's
        bound from then, so the members that came are not dropped for the time it took:
        returns that later deadline, or None where every member came."""
        await self._leave_epoch(REFORM, version)
        lost: float | None = None
        for _ in range(len(members) + 2):  # each try drops a member at least, or ends
            self._epoch += 1
            epoch = self._epoch
            self._members = members
            for member in members:
                self._names[member.uid] = member.name
            self._fleet.set_members(members)
            self._keeping.wrote_epoch(epoch, len(members) + 1)
            if not members:
                await self._blocking(
                    functools.partial(self._epoch_alone, epoch), bound(deadline), "epoch"
                )
                return lost
            came = await self._blocking(
                functools.partial(self._gather_check_ins, epoch, members, deadline),
                bound(deadline) + CHECK_IN_SECONDS,
                "the check-ins",
            )
            if came is None:  # another wrote this epoch's list: take the next one
                continue
            missing = [m for m in members if m.uid not in came]
            if not missing:
                try:
                    self._gang = await self._go_and_make(epoch, members, deadline)
                except (GangError, RuntimeError) as error:
                    if isinstance(error, StoreTrouble):
                        raise
                    why = f"epoch {epoch}'s group could not be made: {one_line(error)}"
                    missing = await self._blocking(
                        functools.partial(self._fleet.silent_among, members), _STEP_SECONDS, "beats"
                    )
                else:
                    await self._blocking(
                        functools.partial(self._keeping.epoch_made, epoch), _STEP_SECONDS, "tidying"
                    )
                    return lost
            else:
                await self._blocking(
                    functools.partial(self._channel.say_go, epoch, False), _STEP_SECONDS, "go"
                )
                why = (
                    f"admitted to epoch {epoch} at version {version}, but did not come to "
                    f"make its group within {CHECK_IN_SECONDS:g} s (dead or stopped)"
                )
            for member in missing:
                self._unreported[member.name] = why
            await self._blocking(
                functools.partial(self._drop_all, {m.uid: why for m in missing}),
                _STEP_SECONDS,
                "drops",
            )
            members = [m for m in members if m not in missing]
            deadline = max(deadline, self._recovery_bound(time.monotonic()))
            lost = deadline
        self._members = []
        self._fleet.set_members([])
        return lost

    async def _go_and_make(self, epoch: int, members: list[Member], deadline: float) -> Gang:
        """Says go for ``epoch`` and makes its gang, one step on one thread; a gang made
        for a push that was cancelled meanwhile is closed (``agang._weights.blocking``
        rule 2). One step: the members that read go wait in the gang's rendezvous until
        the publisher comes, or their timeout, so a go said must be followed by the
        making, whatever becomes of the push: one cancelled as its thread said go, in a
        step of its own, left them there for the subscribers' timeout, and the next push
        dropped them for not checking in to its epoch (rule 6)."""
        channel = self._channel

        def go_and_make() -> Gang:
            try:
                channel.say_go(epoch, True)
            except Exception as error:  # the store's (rule 7), not the group's
                raise store_trouble("go", channel.address, error) from error
            return self._factory(
                channel.group_store(),
                channel.group_prefix(epoch),
                rank=0,
                members=[self._me, *members],
                name=gang_name(channel.name, channel.session, epoch),
                timeout=bound(deadline),
                op_timeout=self._timeout,
            )

        return await blocking(
            go_and_make,
            _STEP_SECONDS + bound(deadline) + 2.0,
            what=f"making epoch {epoch}'s group",
            store=self._channel.address,
            abandoned=lambda made: made.close_sync(),
            store_op=False,
        )

    def _epoch_alone(self, epoch: int) -> None:
        """``epoch`` has no subscriber: the publisher alone, and no group (blocking)."""
        self._channel.set_members(epoch, [self._me])
        self._keeping.epoch_made(epoch)

    def _gather_check_ins(
        self, epoch: int, members: list[Member], deadline: float
    ) -> set[str] | None:
        """Writes the members of ``epoch`` and waits for their check-ins (blocking);
        None where another wrote the epoch's list first."""
        if not self._channel.set_members(epoch, [self._me, *members]):
            return None
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
        self._renew_held()
        self._abandoned.append(gang)  # cancelled mid-broadcast, its op may hold bucket 0
        try:
            if not gang.closed:
                header = self._buckets.header
                header.copy_(torch.tensor([what, version, self._epoch + 1, 0]))
                with contextlib.suppress(GangError):  # a member gone: the abort told them
                    await gang.broadcast(self._buckets.wire[0], 0, timeout=5.0)
        finally:
            with anyio.CancelScope(shield=True):  # cancelled or not, the gang is closed
                await gang.close()

    # Rules 2, 3: the round and its recovery.

    async def _round_with_recovery(self, version: int, deadline: float) -> set[str]:
        """The uids of the subscribers that confirmed ``version`` (rule 3)."""
        delivered: set[str] = set()
        for attempt in range(2):
            if self._gang is None:
                return delivered
            acked, failure = await self._round(version, deadline)
            delivered |= acked
            if failure is None:
                return delivered
            failed_at = time.monotonic()
            recovery = self._recovery_bound(failed_at)
            # The news first: a member that closed since the last beat is not blamed.
            await self._blocking(self._fleet.look_now, bound(recovery), "reading the news")
            seen = self._fleet.take()
            self._unreported.update(seen.dropped)
            self._taken += seen.joiners
            kept = [m for m in self._members if m.uid not in {*seen.leaving, *seen.dead}]
            for member in self._members:
                if member.uid in seen.leaving:
                    self._unreported[member.name] = "it closed (left the channel)"
                elif member.uid in seen.dead:  # rule 8: not asked, it is dead
                    self._unreported[member.name] = seen.dead[member.uid]
            missing = [m for m in kept if m.uid not in acked]
            answers = await self._blocking(
                functools.partial(self._channel.ask, [m.uid for m in missing]),
                bound(recovery),
                "asking the subscribers",
            )
            error = one_line(failure).rstrip(".")
            why_of = {}
            for member in missing:
                answer = answers.get(member.uid)
                if answer is None or attempt == 1:
                    said = _NO_ANSWER if answer is None else f"failed twice; it says: {answer}"
                    why = f"{said}; version {version}'s round failed: {error}"
                    self._unreported[member.name] = why
                    why_of[member.uid] = why
                    kept.remove(member)
            if why_of:
                await self._blocking(
                    functools.partial(self._drop_all, why_of), bound(recovery), "drops"
                )
            joiners = [j for j in self._taken if j.uid not in {m.uid for m in kept}]
            later = await self._reform([*kept, *joiners], version, recovery)
            self._taken = []
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
            # On the gang's device (NCCL takes no other): bucket 0's.
            acks = [torch.zeros_like(buckets.header[:2]) for _ in self._members]
            for rank, ack in enumerate(acks, 1):
                handles.append(gang.recv(ack, rank, timeout=bound(deadline, 0.001)))
        except GangError as error:
            failure = error
            acks = []
        # The last issued first: the confirmations end last, and a handle that ended
        # before it is awaited costs no wake-up of the loop (one a push, not one an op).
        # Cancelled here, the push's abandon lets them end, or closes the gang (rule 6).
        self._in_flight = handles
        if self._fleet.any_dead(self._members):
            # A notice heard after this push's sighting, before its ops were in flight:
            # ``_member_died`` found none to end then, so this round ends here (rule 8).
            self._member_died()
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
            self._gang = None
            self._abandoned.append(gang)
            start_daemon(gang.close_sync, name=f"agang: weights: close gang '{gang.name}'")
        return acked, failure

    def _renew_held(self) -> None:
        """A new buffer for each bucket an op of a failed or abandoned round still holds
        (``Gang.holds``; the buckets' rule 6), so that this round neither waits for that
        op nor fails. Only such rounds leave ops behind: a push after good ones looks at
        nothing. The new buffers are this round's alone: the old gangs never see them."""
        if not self._abandoned:
            return
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
        with anyio.CancelScope(shield=True):
            await self._leave_epoch(CLOSE, self._last or 0)
            self._fleet.stop()
            await run_blocking(self._listening.stop, name="weights: stop listening", seconds=5.0)
            if self._fleet.fenced_by is not None:
                return  # the channel is another's: its keys are not this one's to tidy
            try:
                await self._blocking(self._say_closed, _STEP_SECONDS, "closing the channel")
            except GangError as error:
                log.info("agang: closing channel '%s': %s", self._channel.name, error)

    def _say_closed(self) -> None:
        self._channel.say_closed("closed")
        self._keeping.closing()

    def close_sync(self) -> None:
        """[`close`][agang.WeightPublisher.close] for programs without an event loop."""
        run_sync(self.close)
