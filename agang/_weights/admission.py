"""Who is in each epoch of a weights channel: ``Admission``, which ``WeightPublisher``
owns (``agang._weights.publisher``). It takes what the fleet saw, drops who left, moves
the members to new epochs and makes each epoch's gang; the round on that gang, and the
header that tells the old gang to reform, are the publisher's.

Rules:
1. *Membership at round boundaries.* A push first takes what the fleet saw since the
   last one (``agang._weights.fleet``, no store op): the subscribers registered since,
   the members that closed, were seen silent, were named by a death notice
   (``agang._weights.publisher`` rule 8), or were replaced (a joiner with the name of a
   member replaces it: a restarted server). Where anything changed, the members move
   to a new epoch: the old gang is told ``REFORM`` in bucket 0's header (the
   publisher's ``leave``), the new members are written, every one checks in, then all
   make the new gang (the channel's factory, ``agang._membership.gangs``).
2. A member that does not come to make a new epoch's gang within ``CHECK_IN_SECONDS``
   is dropped, and the epoch after is made without it, within the recovery's bound
   from then; a joiner that did not come gives the round that follows that bound too,
   so that the members are not dropped for the time it took. Every step is bounded.
3. *After a failed round* (``agang._weights.publisher`` rule 3). The news first: a
   member that closed since the last beat is not blamed, and one a death notice named
   is dropped with the watcher's why, not asked. The others that did not confirm (in
   either round of the push) are asked where they stand (blame,
   ``agang._weights.channel`` rule 5); those that do not answer, and on the second
   failure all of them, are dropped, with why, and the rest move to a new epoch, within
   ``RECOVERY_SECONDS`` (plus the time the bytes take at ``RECOVERY_BYTES_PER_SECOND``)
   after the failure.
   *Stalled.* One failed round does not say whose the failure was: a round is the
   members' collective, so one member that does not take its buckets (stalled, while
   its process answers) holds every other one's round up too, and none confirms. So,
   where the epochs' transport ends every peer's ops when the publisher ends the
   group (Gloo: ``agang._setup.epoch_gang`` rule 1), a member whose answer says that
   its rounds still wait in the failed epoch's group (``channel.still_in_group``) is
   asked again until ``NOTICE_SECONDS`` after the failure: one that still does is
   stalled, and dropped, with why, at the first failure, so that the round runs again
   without it, and the others take the version within the bound. Without that test a
   stalled member that answered was kept for the second round, which it failed again,
   and every healthy member with it (all dropped, "failed twice"). A member behind the
   stalled one in Gloo's broadcast tree waits on it, not on the publisher, and is
   dropped with it; the next push admits it again. On NCCL a peer's kernels wait after
   the publisher's abort, so no member is judged so there.
4. *Cancellation* (``agang._weights.publisher`` rule 6). The state is whole at every
   await, so a push cancelled anywhere leaves members, an epoch and a gang (or None:
   the next push reforms) that the next push goes on from; the joiners it took are
   given back (``give_back``), and the next push admits them. An epoch whose go was
   said has its gang made, and then closed, by the thread that said it, since its
   members wait in that gang's rendezvous (``_go_and_make``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, final

from agang._errors import GangError, one_line
from agang._gang import Gang
from agang._membership.gangs import GangFactory
from agang._membership.member import Member
from agang._weights.blocking import STEP_SECONDS, StoreTrouble, blocking, bound, store_trouble
from agang._weights.channel import Channel, still_in_group
from agang._weights.epoch import gang_name
from agang._weights.fleet import Fleet
from agang._weights.housekeeping import Housekeeping

#: The recovery's bound after a failure (plus the bytes' time): a push that lost a
#: subscriber returns at most this long after its failure (measured in the tests, under
#: load: 0.35-0.42 s after a kill, 0.37-0.39 s past the deadline after a stop). A
#: survivor closes the failed epoch's gang on a thread of its own, so that close, which
#: can take seconds, is not in it.
RECOVERY_SECONDS = 2.0
RECOVERY_BYTES_PER_SECOND = 200e6
CHECK_IN_SECONDS = 2.0
#: How long after a failure a member's rounds may still wait in the failed epoch's
#: group, the publisher having ended it, before the member is judged stalled (rule 3):
#: a healthy one's ops end within milliseconds of the abort, its loop's wake-up after.
NOTICE_SECONDS = 0.5
_POLL = 0.01
_NO_ANSWER = "no answer (dead, stopped, or cut off from the store)"


@final
class Admission:
    """The publisher's members, epoch and gang, and who moves in and out (module rules).

    Args:
        channel: The publisher's session.
        fleet: Its subscribers, as its thread sees them.
        keeping: Its housekeeping (drops and epochs go through it).
        factory: Makes each epoch's gang.
        me: The publisher: rank 0 of every epoch.
        op_timeout: The epochs' gangs' op timeout (None: none).
        nbytes: The bytes a round moves (the recovery's bound grows with them).
        leave: The publisher's: tells the current gang ``REFORM`` at a version, and
            closes it (rule 1).
        aborts_seen: Whether the epochs' peers see the publisher end a group (their
            ops end: Gloo), so that a member still in it is stalled (rule 3).
    """

    def __init__(
        self,
        channel: Channel,
        fleet: Fleet,
        keeping: Housekeeping,
        factory: GangFactory,
        me: Member,
        op_timeout: float | None,
        nbytes: int,
        leave: Callable[[int], Awaitable[None]],
        aborts_seen: bool,
    ) -> None:
        self._channel = channel
        self._fleet = fleet
        self._keeping = keeping
        self._factory = factory
        self._me = me
        self._op_timeout = op_timeout
        self._nbytes = nbytes
        self._leave = leave
        self._aborts_seen = aborts_seen
        self._members: list[Member] = []  # the current epoch's subscribers, by rank - 1
        self._gang: Gang | None = None  # None with members: the next push reforms
        self._epoch = -1
        self._taken: list[Member] = []  # joiners taken from the fleet, not admitted yet
        self._unreported: dict[str, str] = {}  # drops no report has named yet
        self._names: dict[str, str] = {}  # uid -> name, of every member of this push

    @property
    def members(self) -> list[Member]:
        """The current epoch's subscribers, by rank - 1 (do not change the list)."""
        return self._members

    @property
    def epoch(self) -> int:
        """The current epoch (-1 before the first)."""
        return self._epoch

    @property
    def gang(self) -> Gang | None:
        """The current epoch's gang; None where it was left (the next push reforms)."""
        return self._gang

    def take_gang(self) -> Gang | None:
        """The current gang, forgotten here: the caller closes it, and the next push
        moves the members to a new epoch."""
        gang, self._gang = self._gang, None
        return gang

    def give_back(self) -> None:
        """The joiners a push took and did not admit go back to the fleet (rule 4)."""
        self._fleet.put_back(self._taken)
        self._taken = []

    def take_dropped(self) -> dict[str, str]:
        """The drops no report has named yet, by name, with why; forgotten here."""
        dropped, self._unreported = self._unreported, {}
        return dropped

    def names_of(self, uids: Iterable[str]) -> tuple[str, ...]:
        """The names of the members ``uids``, sorted, each once."""
        return tuple(sorted({self._names[uid] for uid in uids}))

    def recovery_bound(self, failed_at: float) -> float:
        """When a recovery that began at ``failed_at`` must end (rule 3)."""
        return failed_at + RECOVERY_SECONDS + self._nbytes / RECOVERY_BYTES_PER_SECOND

    def write_members_again(self) -> None:
        """Writes the current epoch's members again, if there is one, for a store that
        lost the session (``agang._weights.fleet`` rule 4; blocking)."""
        if self._epoch >= 0:
            self._channel.set_members(self._epoch, [self._me, *self._members])

    async def admit(self, version: int, deadline: float) -> float:
        """Admits the joiners, drops who left, went silent or was replaced (rule 1);
        returns the round's deadline, later where a joiner did not come (rule 2)."""
        seen = self._fleet.take()
        self._unreported.update(seen.dropped)
        self._taken += seen.joiners
        gone: dict[str, str] = {}  # uid -> why, told to each
        for member in self._members:
            if member.uid in seen.dead:  # the publisher's rule 8
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
        self._members = members  # the state is whole at every await below (rule 4)
        if gone:
            self._fleet.set_members(members)
            told = {uid: why for uid, why in gone.items() if why}
            if told:
                await self._blocking(functools.partial(self._drop_all, told), STEP_SECONDS, "drops")
        if not changed:
            return deadline
        joiners = [j for j in self._taken if j.uid not in {m.uid for m in members}]
        later = await self._reform([*members, *joiners], version, deadline)
        self._taken = []
        return deadline if later is None else later

    async def recover(
        self, version: int, acked: set[str], failure: BaseException, last: bool
    ) -> float:
        """After a round of ``version`` that failed with ``failure`` (rule 3): drops the
        members that did not confirm (``acked``: the uids that did, in either round) and
        do not answer, or are stalled, or all of them on the ``last`` try, and moves the
        rest to a new epoch; returns the next round's deadline."""
        recovery = self.recovery_bound(time.monotonic())
        noticed_by = time.monotonic() + NOTICE_SECONDS
        # The news first: a member that closed since the last beat is not blamed.
        await self._blocking(self._fleet.look_now, bound(recovery), "reading the news")
        seen = self._fleet.take()
        self._unreported.update(seen.dropped)
        self._taken += seen.joiners
        kept = [m for m in self._members if m.uid not in {*seen.leaving, *seen.dead}]
        for member in self._members:
            if member.uid in seen.leaving:
                self._unreported[member.name] = "it closed (left the channel)"
            elif member.uid in seen.dead:  # not asked, it is dead
                self._unreported[member.name] = seen.dead[member.uid]
        missing = [m for m in kept if m.uid not in acked]
        answers = await self._blocking(
            functools.partial(self._ask, [m.uid for m in missing], noticed_by),
            bound(recovery),
            "asking the subscribers",
        )
        error = one_line(failure).rstrip(".")
        why_of = {}
        for member in missing:
            answer = answers.get(member.uid)
            stalled = answer is not None and self._stalled(answer)
            if answer is None or stalled or last:
                if answer is None:
                    said = _NO_ANSWER
                elif stalled:
                    said = (
                        f"stalled: its round still waited in epoch {self._epoch}'s group "
                        f"{NOTICE_SECONDS:g} s after the publisher ended it (its receive "
                        f"side stopped or too slow); it says: {answer}"
                    )
                else:
                    said = f"failed twice; it says: {answer}"
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
        return recovery if later is None else later

    def _blocking(self, fn: Callable[[], Any], seconds: float, what: str) -> Any:
        return blocking(fn, seconds, what=what, store=self._channel.address)

    def _stalled(self, answer: str) -> bool:
        """Whether ``answer`` says its rounds still wait in the failed epoch's group,
        which the publisher ended (rule 3)."""
        return self._aborts_seen and still_in_group(answer, self._epoch)

    def _ask(self, uids: list[str], until: float) -> dict[str, str | None]:
        """Each of ``uids``' answer, None for one that gave none; one whose rounds still
        wait in the failed epoch's group is asked again until it says it left, or until
        ``until`` (rule 3; blocking)."""
        answers = self._channel.ask(uids)
        while True:
            waiting = [uid for uid, a in answers.items() if a is not None and self._stalled(a)]
            if not waiting or time.monotonic() >= until:
                return answers
            time.sleep(_POLL * 5)
            answers.update(self._channel.ask(waiting))

    def _drop_all(self, why_of: dict[str, str]) -> None:
        """Drops each uid of ``why_of``, telling it why (blocking)."""
        alive = self._fleet.alive() - set(why_of)
        for uid, why in why_of.items():
            self._keeping.dropped(uid, why, alive)

    async def _reform(self, members: list[Member], version: int, deadline: float) -> float | None:
        """Moves to a new epoch of ``members`` (rules 1, 2) and drops those that do not
        come. A try that failed gives the next one, and the round after, the recovery's
        bound from then, so the members that came are not dropped for the time it took:
        returns that later deadline, or None where every member came."""
        await self._leave(version)
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
                        functools.partial(self._fleet.silent_among, members), STEP_SECONDS, "beats"
                    )
                else:
                    await self._blocking(
                        functools.partial(self._keeping.epoch_made, epoch), STEP_SECONDS, "tidying"
                    )
                    return lost
            else:
                await self._blocking(
                    functools.partial(self._channel.say_go, epoch, False), STEP_SECONDS, "go"
                )
                why = (
                    f"admitted to epoch {epoch} at version {version}, but did not come to "
                    f"make its group within {CHECK_IN_SECONDS:g} s (dead or stopped)"
                )
            for member in missing:
                self._unreported[member.name] = why
            await self._blocking(
                functools.partial(self._drop_all, {m.uid: why for m in missing}),
                STEP_SECONDS,
                "drops",
            )
            members = [m for m in members if m not in missing]
            deadline = max(deadline, self.recovery_bound(time.monotonic()))
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
        dropped them for not checking in to its epoch (rule 4)."""
        channel = self._channel

        def go_and_make() -> Gang:
            try:
                channel.say_go(epoch, True)
            except Exception as error:  # the store's (the publisher's rule 7), not the group's
                raise store_trouble("go", channel.address, error) from error
            return self._factory(
                channel.group_store(),
                channel.group_prefix(epoch),
                rank=0,
                members=[self._me, *members],
                name=gang_name(channel.name, channel.session, epoch),
                timeout=bound(deadline),
                op_timeout=self._op_timeout,
            )

        return await blocking(
            go_and_make,
            STEP_SECONDS + bound(deadline) + 2.0,
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
