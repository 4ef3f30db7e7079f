"""Elastic set-up: forming an epoch's gang from whoever ``membership`` admits.

Rules (blocking, on set-up threads; never on the loop):
1. The store is one that outlives every rank (``agang store`` at ``MASTER_ADDR:
   MASTER_PORT``): no rank hosts it, so losing any rank loses no state.
2. Each epoch has its own process group, made on the store under the epoch's prefix,
   with ranks given by the member list's order; and its own blame channel (the
   responders answer on the epoch's prefix), so a process of an old epoch never reaches
   a new epoch's keys.
3. A group whose creation fails (a member died after the decision) is destroyed, and
   the next epoch is formed by whoever is left, within the same deadline. One attempt
   waits at most ``GROUP_ATTEMPT_SECONDS`` for the members: all were alive at the
   decision moments before, so one that has not checked in to make the group by then is
   gone, and waiting for it until the deadline would leave no time to form the next
   epoch. A member still closing its old gang is not gone: closing aborts the old
   communicator, which may take seconds (a Gloo group waits for its peers' connections
   to close), so it says so every ``CLOSING_BEAT`` seconds meanwhile (``closing``), and
   the others wait for it while its last beat is under ``CLOSING_GRACE`` old; one that
   dies while closing stops beating and is gone soon after. Once every member checked
   in, connecting may take the rest of the deadline (a loaded machine took over 3 s).
   No responder
   serves a group never made, so that next formation takes as alive the members that
   checked in to make it, for ``GROUP_ATTEMPT_SECONDS`` (their own attempts end then,
   about when this one's did); the others are gone.
4. Each reform talks to the store on a connection of its own, made within its deadline.
   A store call on an established connection whose peer went silent (a cut link, a
   stopped store) blocks in c10d whatever the client's timeout: a rank cut off before
   the reform then fails to connect, in time, instead of leaving a thread stuck there
   (one that returns while the process exits aborts it). Connecting blocks so too where
   the store takes the connection and never answers (a stopped store process: the
   kernel accepts for it), so each attempt runs on a thread of its own that is given up
   on at the deadline, and the error names the store and says it did not answer.
5. Connecting is ``agang._membership.store``'s, as for every member of a
   membership: c10d's C++ log stays quiet, and each failed try is one INFO line.
6. Elastic set-up talks to the members through their mailboxes
   (``agang._backends.c10d.mailbox``), with letters of its own kinds, registered
   here: ``ping <key>`` asks whether a member is alive (its responder answers its index
   under the key: ``ping``); ``joining <id>`` says a process waits to join the next
   epoch (counted locally: ``noticed``; a reform forgets them); ``reforming <who>``
   says a member started the next epoch, and is the elastic gang's own to handle
   (``agang._setup.elastic_gang``). A waiting joiner also beats on the store
   (membership rule 2), so that no reform waits for one that died.
7. A joiner never waits silently. Where the gang is at ``max_size``, no reform can
   admit it and its members do not count it (``waiting_to_join``): it says so in an
   INFO line at each such epoch, and waits for a member to leave; at its deadline its
   error says why it was not admitted, and it withdraws its registration, so that no
   reform waits for it any more.
8. Losing the store loses the job. The store is the job's only shared state (rule 1),
   kept in its memory: one restarted, even on the same port, holds none of it, and
   the job is not made again from what the members remember. Each reform checks, on
   its new connection, that the store still holds the job's id (membership rule 6),
   and fails naming the store where not; a member whose mailbox connection fails
   breaks its gang at once (``agang._setup.elastic_gang``, rule 5), so the members
   fail at their next op or step boundary, not at their next reform. A newcomer on the
   restarted store cannot know of them until one of them has looked; after that,
   formation 0 there is refused.
9. *Namespaces.* A gang formed under a namespace (``agang.ray``'s: one per gang of a
   job, on the job's one store) keeps every key under that prefix, so gangs of a job
   never meet; its process groups are registered nowhere (``make_group(private=
   True)``, on the epoch gangs' makers), so the default group, if any, stays its
   owner's. Death notices' directory stays at the store's root (the watcher that
   files a notice knows no gang), so a listener names its mailbox by its full key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from agang._backends.c10d import mailbox
from agang._backends.c10d import world as c10d_world
from agang._backends.c10d.retry import TransientSetupError
from agang._errors import GangInitError
from agang._membership import questions
from agang._membership import store as stores
from agang._membership.heartbeat import start_beat
from agang._membership.member import Member
from agang._runtime import fork
from agang._setup import membership, simulation
from agang._setup.env import WorldInfo
from agang._setup.epoch_gang import gloo_group
from agang._setup.nccl_epoch_gang import nccl_group
from agang._setup.process import apply_nccl_settings
from agang._setup.rendezvous import BARRIER_SECONDS, prove

log = logging.getLogger("agang.setup")

#: The most one attempt at an epoch's group waits for its members to check in to make
#: it (seconds; rule 3). Once all have, making the group may take the rest of the deadline.
GROUP_ATTEMPT_SECONDS = 3.0
_CHECK_IN_POLL = 0.02
#: How often a member closing its old gang says so, and how long after its last beat
#: the others still wait for it (rule 3).
CLOSING_BEAT = 0.2
CLOSING_GRACE = 1.0


# Rule 6: the mailbox letters of elastic set-up.


def _answer_ping(responder: mailbox.Responder, key: str) -> None:
    responder.reply(key, str(responder.world_rank))


_noticed_lock = threading.Lock()
_noticed: set[str] = set()


def _notice_joiner(responder: mailbox.Responder, uid: str) -> None:
    with _noticed_lock:
        _noticed.add(uid)


def _forget_in_child() -> None:
    # The notices were the parent's members'; a parent thread may have held the lock.
    global _noticed_lock, _noticed, _dead_lock, _dead
    _noticed_lock = threading.Lock()
    _noticed = set()
    _dead_lock = threading.Lock()
    _dead = set()


mailbox.register("ping", _answer_ping)
mailbox.register("joining", _notice_joiner)
fork.on_fork_in_child(_forget_in_child)


#: How often a member looks at the beats of the joiners it heard of (membership rule 2).
JOINER_LOOK = 0.3


class LookingDone(Exception):
    """Ends a member's watch of the joiners: its gang closed."""


def watch_joiners(store: Any, alive: Callable[[], bool]) -> threading.Event:
    """Looks at the beats of the joiners this process heard of, every ``JOINER_LOOK``
    seconds on a thread of its own, while ``alive()`` (the gang is open) and until the
    event returned is set (membership rule 2): a reform's decider then knows a joiner
    that died already. No store op while no joiner waits."""

    def look(_: int) -> None:
        if not alive():
            raise LookingDone
        waiting = noticed()
        if waiting:
            membership.look_at_joiners(store, waiting)

    return start_beat(look, JOINER_LOOK, name="elastic joiners' watch", at_once=False)


_dead_lock = threading.Lock()
_dead: set[str] = set()


def say_dead(uids: set[str]) -> None:
    """Members a death notice named (``agang._membership.deaths``): every later reform of
    this process leaves them out without pinging them."""
    with _dead_lock:
        _dead.update(uids)


def reported_dead() -> set[str]:
    with _dead_lock:
        return set(_dead)


def noticed() -> set[str]:
    """The processes that said they wait to join the next elastic epoch."""
    with _noticed_lock:
        return set(_noticed)


def forget_noticed() -> None:
    """Forgets every notice (a reform begins: joiners still waiting notify again)."""
    with _noticed_lock:
        _noticed.clear()


def ping(store: Any, world_ranks: list[int], seconds: float) -> set[int]:
    """The ``world_ranks`` whose responder (on ``store``, an elastic epoch's) answers
    within ``seconds``: alive, and not stopped (``agang._membership.questions``)."""
    # An asker of its own: one kept across reforms would keep each reform's store
    # connection (its late answers' store) open after the reform.
    answers = questions.Asker().ask([(store, rank) for rank in world_ranks], "ping", seconds)
    return {rank for rank, answer in zip(world_ranks, answers, strict=True) if answer}


@dataclass(frozen=True)
class Elastic:
    """Makes [`agang.init`][agang.init] form an elastic gang, which survives the loss of ranks.

    Args:
        min_size: The fewest members a formation or reform accepts. A reform with fewer
            waits for more (joiners included) until its deadline, and forms as soon as
            there are ``min_size``; fewer at the deadline raise ``GangInitError``.
            ``WORLD_SIZE`` must be at least ``min_size`` (formation 0 takes no more).
        max_size: The most members a gang takes (None: no bound). The rest wait, each
            until a member leaves and a reform admits it, or until its own deadline;
            ``waiting_to_join()`` does not count them while the gang is at ``max_size``.

    Example:
        <!-- not-run: an elastic init joins a launched world that may change -->
        ```python
        gang = await agang.init(elastic=agang.Elastic(min_size=2), timeout=60)
        ```
    """

    min_size: int = 1
    max_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, int):
            raise TypeError(f"`min_size` must be an int, but is {self.min_size!r} instead.")
        if self.min_size < 1:
            raise ValueError(f"`min_size` must be at least 1, but is {self.min_size} instead.")
        if self.max_size is not None:
            if isinstance(self.max_size, bool) or not isinstance(self.max_size, int):
                raise TypeError(
                    f"`max_size` must be an int or None, but is {self.max_size!r} instead."
                )
            if self.max_size < self.min_size:
                raise ValueError(
                    f"`max_size` must be at least `min_size` ({self.min_size}), but is "
                    f"{self.max_size} instead."
                )


@dataclass(frozen=True)
class StoreView:
    """The store as one gang sees it (rule 9): ``store``, its keys under ``namespace``
    of the client ``root`` (the client itself where there is no namespace)."""

    root: Any
    namespace: str = ""

    @functools.cached_property
    def store(self) -> Any:
        if not self.namespace:
            return self.root
        return dist.PrefixStore(self.namespace, self.root)  # type: ignore[attr-defined]

    def full_key(self, key: str) -> str:
        """``key`` of the gang's store as a key of the root store."""
        return f"{self.namespace}/{key}" if self.namespace else key


@dataclass
class Formed:
    """One epoch's membership, and this process's place in it."""

    world: WorldInfo
    view: StoreView
    me: Member
    epoch: int
    members: list[Member]
    #: The job's id on the store (membership rule 6): checked at each reform (rule 8).
    job: str

    @property
    def rank(self) -> int:
        return next(i for i, c in enumerate(self.members) if c.uid == self.me.uid)

    @property
    def store(self) -> Any:
        """The gang's view of the store (rule 9)."""
        return self.view.store


def connect_store(world: WorldInfo, deadline: float, namespace: str = "") -> StoreView:
    """A client of the store that outlives the ranks (rule 1), retried until ``deadline``
    (``agang._membership.store``, rules 1 and 2; rule 4 here), seen under ``namespace``
    (rule 9)."""
    root = stores.connect(
        world.master_addr,
        world.master_port,
        deadline,
        need="An elastic gang needs",
        who=f"rank {world.rank}",
    )
    return StoreView(root, namespace)


def first_formation(view: StoreView, world: WorldInfo, elastic: Elastic, deadline: float) -> Formed:
    """Formation 0, or, where it already happened, the next reform as a joiner."""
    store = view.store
    me = membership.me(world.rank)
    if membership.current_epoch(store) is None:
        if world.world_size < elastic.min_size:
            # Formation 0 takes WORLD_SIZE processes at most: it would wait out the
            # deadline for members that can never come.
            raise GangInitError(
                f"`min_size` {elastic.min_size} of `elastic` is more than WORLD_SIZE "
                f"{world.world_size}: formation 0 takes at most WORLD_SIZE processes."
            )
        members = membership.form(
            store,
            me,
            0,
            previous=None,
            target=world.world_size,
            min_size=elastic.min_size,
            max_size=elastic.max_size,
            deadline=deadline,
            alive=lambda indices: set(),
        )
        if members is not None:
            return _formed(world, view, me, 0, members)
    return join(world, view, me, elastic, deadline)


def join(
    world: WorldInfo, view: StoreView, me: Member, elastic: Elastic, deadline: float
) -> Formed:
    """Waits, as a joiner, for the next reform that admits this process; tells the
    current members' responders that it waits (``waiting_to_join``). Gives up at
    ``deadline``, saying why, and so that no reform waits for it any more. Beats while
    it waits (membership rule 2), so that a reform does not wait for it once it died."""
    store = view.store
    stop = _beat_while_waiting(store, me)
    try:
        membership.register_joiner(store, me)
        return _wait_for_admission(world, view, me, elastic, deadline)
    except GangInitError:
        with contextlib.suppress(Exception):  # a store gone: no reform waits for it either
            membership.withdraw_joiner(store, me)
        raise
    finally:
        stop.set()


def _beat_while_waiting(store: Any, me: Member) -> threading.Event:
    """Beats once, then every ``JOINER_BEAT`` seconds on a thread of its own (a reform's
    store calls may block the waiting one), until the event returned is set; a process
    that ends stops it with itself. The first beat comes before the registration, so
    that a registered joiner without one is dead, or never waited."""
    membership.say_waiting(store, me, 1)
    return start_beat(
        lambda count: membership.say_waiting(store, me, count + 1),
        membership.JOINER_BEAT,
        name="elastic joiner beat",
        at_once=False,
    )


def _wait_for_admission(
    world: WorldInfo, view: StoreView, me: Member, elastic: Elastic, deadline: float
) -> Formed:
    store = view.store
    told: int | None = None
    full = False  # the newest epoch is at max_size: no reform can admit this process yet
    while time.monotonic() < deadline:
        current = membership.current_epoch(store)
        if current is not None and current != told:
            # Each epoch's members hear it (a reform forgets the notices it had).
            size = _tell_members(store, current, me)
            told = current
            full = elastic.max_size is not None and size >= elastic.max_size
            if full:  # its members do not count it: say why it waits, not silently
                log.info(
                    "agang: %s waits to join the elastic gang, which is at max_size=%d "
                    "(epoch %d): a reform can admit it once a member leaves.",
                    me.where,
                    elastic.max_size,
                    current,
                )
        following = 0 if current is None else current + 1
        if not store.check([membership.epoch_key(following, "arrived")]):
            time.sleep(0.05)  # no reform under way yet
            continue
        members = membership.form(
            store,
            me,
            following,
            previous=None,
            target=0,
            min_size=elastic.min_size,
            max_size=elastic.max_size,
            deadline=deadline,
            alive=lambda indices: set(),
        )
        if members is not None:
            return _formed(world, view, me, following, members)
    why = (
        f"the gang is at max_size={elastic.max_size}; no member left to make room for it"
        if full
        else "the elastic gang's members had not called reform() by then"
    )
    raise GangInitError(f"No reform admitted this process ({me.where}) before its deadline: {why}.")


def _tell_members(store: Any, epoch: int, me: Member) -> int:
    """Tells epoch ``epoch``'s members' responders that ``me`` waits to join; returns
    how many members the epoch has."""
    size = len(membership.members_of(store, epoch))
    epoch_store = dist.PrefixStore(  # type: ignore[attr-defined]
        membership.epoch_key(epoch, "blame"), store
    )
    mailbox.post(epoch_store, list(range(size)), "joining", me.uid)
    return size


def reform_membership(
    formed: Formed, elastic: Elastic, deadline: float, *, made: bool = True
) -> Formed:
    """The members of the next epoch, decided with the survivors and joiners (the old
    gang still open, so its responder answers the others' pings); where ``formed``'s
    group was never ``made``, with those that checked in to make it (rule 3)."""
    view = connect_store(formed.world, deadline, formed.view.namespace)  # rule 4
    store = view.store
    membership.check_job(store, formed.job, formed.epoch, formed.world.store_address)  # rule 8
    old_epoch_store = dist.PrefixStore(  # type: ignore[attr-defined]
        membership.epoch_key(formed.epoch, "blame"), store
    )
    first_asked: list[float] = []

    def alive(indices: list[int]) -> set[int]:
        # A member a death notice named is dead: asking it would only cost the wait.
        indices = [i for i in indices if formed.members[i].uid not in reported_dead()]
        if not indices:
            return set()
        if made:
            return ping(old_epoch_store, indices, membership.PING_SECONDS)
        first_asked.append(time.monotonic())
        if time.monotonic() - first_asked[0] > GROUP_ATTEMPT_SECONDS:
            return set()
        checked_in = membership.checked_in(store, formed.epoch)
        return {i for i in indices if formed.members[i].uid in checked_in}

    following = formed.epoch + 1
    # The other members may still wait on an op that will never finish (only the ranks
    # next to a dead one see its connection drop): tell them, so they come at once.
    others = [i for i in range(len(formed.members)) if i != formed.rank]
    text = f"{following} by rank {formed.rank} ({formed.me.where})"
    mailbox.post(old_epoch_store, others, "reforming", text)
    members = membership.form(
        store,
        formed.me,
        following,
        previous=formed.members,
        target=0,
        min_size=elastic.min_size,
        max_size=elastic.max_size,
        deadline=deadline,
        alive=alive,
    )
    if members is None:  # this process came after the decision: wait for the next one
        return join(formed.world, view, formed.me, elastic, deadline)
    return Formed(formed.world, view, formed.me, following, members, formed.job)


def _formed(
    world: WorldInfo, view: StoreView, me: Member, epoch: int, members: list[Member]
) -> Formed:
    """``me``'s place in ``epoch`` of the job the store holds, whose id was written
    before any member list (membership rule 6)."""
    job = membership.job_of(view.store)
    if job is None:  # a store written by an agang that did not name its jobs
        raise GangInitError(
            f"The store at {world.store_address} holds elastic epochs but no job id: "
            f"every process of the job must run the same agang."
        )
    return Formed(world, view, me, epoch, members, job)


@contextlib.contextmanager
def closing(formed: Formed) -> Iterator[None]:
    """Says, every ``CLOSING_BEAT`` seconds inside the block, that this member of
    ``formed``'s epoch is closing its old gang and will come to make the group (rule 3)."""
    stop = start_beat(
        lambda _: membership.say_closing(formed.store, formed.epoch, formed.me),
        CLOSING_BEAT,
        name="elastic closing",
    )
    try:
        yield
    finally:
        stop.set()


def _wait_for_check_ins(formed: Formed, until: float, deadline: float) -> None:
    """Returns once every member of ``formed`` checked in to make its group; raises
    ``TransientSetupError`` naming those that did not by ``until``, or by the deadline
    for a member that still said it was closing its old gang (gone: rule 3)."""
    expected = {c.uid: c for c in formed.members}
    beats: dict[str, tuple[int, float]] = {}  # uid: its closing beats, when they changed

    def still_closing(uid: str, now: float) -> bool:
        count = membership.closing_beats(formed.store, formed.epoch, uid)
        if beats.get(uid, (0, now))[0] != count:
            beats[uid] = (count, now)
        return count > 0 and now - beats.get(uid, (0, now))[1] < CLOSING_GRACE

    while True:
        missing = set(expected) - membership.checked_in(formed.store, formed.epoch)
        if not missing:
            return
        now = time.monotonic()
        closing_now = {uid for uid in missing if still_closing(uid, now)}
        if now >= deadline or (now >= until and not closing_now):
            names = ", ".join(sorted(expected[uid].where for uid in missing))
            raise TransientSetupError(
                f"Epoch {formed.epoch}'s group could not be made: {names} did not come to "
                f"make it within {GROUP_ATTEMPT_SECONDS:g} s of the decision (gone)."
            )
        time.sleep(_CHECK_IN_POLL)


def make_group(
    formed: Formed, backend: str, deadline: float, device: Any, private: bool = False
) -> dist.ProcessGroup | None:
    """The epoch's process group (rule 2): the default group, or where ``private``, one
    registered nowhere that is returned (rule 9); raises ``TransientSetupError`` where a
    member is gone (rule 3)."""
    # The epoch's world, for the c10d backend: its mailboxes live on the epoch's prefix
    # (rule 2), and no member hosts the store (rule 1).
    c10d_world.publish(
        c10d_world.World(
            roster=tuple(c.where for c in formed.members),
            store_address=f"{formed.world.master_addr}:{formed.world.master_port}",
            hosts_store=False,
            store_override=dist.PrefixStore(  # type: ignore[attr-defined]
                membership.epoch_key(formed.epoch, "blame"), formed.store
            ),
            rank=formed.rank if private else None,
        )
    )
    membership.check_in(formed.store, formed.epoch, formed.me)
    _wait_for_check_ins(formed, min(deadline, time.monotonic() + GROUP_ATTEMPT_SECONDS), deadline)
    # Every member is alive and making the group: give it the rest of the deadline (a
    # loaded machine may take seconds to connect them).
    seconds = max(1.0, deadline - time.monotonic())
    if private:
        return _private_group(formed, backend, device, seconds, deadline)
    try:
        dist.init_process_group(
            simulation.c10d_name(backend, device),
            store=dist.PrefixStore(  # type: ignore[attr-defined]
                membership.epoch_key(formed.epoch, "pg"), formed.store
            ),
            rank=formed.rank,
            world_size=len(formed.members),
            timeout=timedelta(seconds=seconds),
            device_id=device if device.type == "cuda" else None,
        )
        prove(deadline)
    except Exception as error:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise TransientSetupError(
            f"Epoch {formed.epoch}'s group could not be made (a member may be gone): {error}"
        ) from error
    log.info(
        "agang: elastic epoch %d formed: rank %d of %d.",
        formed.epoch,
        formed.rank,
        len(formed.members),
    )
    return None


def private_name(formed: Formed, part: str = "") -> str:
    """The c10d name of a private world's group of ``formed``'s epoch: the same on every
    member (blame's questions name a gang by it), and no other epoch's or gang's."""
    return f"{formed.view.namespace or 'agang'}/epoch{formed.epoch}{part}"


def _private_group(
    formed: Formed, backend: str, device: Any, seconds: float, deadline: float
) -> dist.ProcessGroup:
    """The epoch's group registered nowhere (rule 9), proven by a barrier."""
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        membership.epoch_key(formed.epoch, "pg"), formed.store
    )
    size, timeout, name = len(formed.members), timedelta(seconds=seconds), private_name(formed)
    group: dist.ProcessGroup | None = None
    try:
        if backend == "gloo":
            group = gloo_group(store, formed.rank, size, timeout, formed.world.master_addr, name)
        else:
            apply_nccl_settings(os.environ)
            group = nccl_group(store, formed.rank, size, timeout, name, device)
        options = dist.BarrierOptions()
        wait = max(0.1, min(BARRIER_SECONDS, deadline - time.monotonic()))
        options.timeout = timedelta(seconds=wait)
        group.barrier(options).wait(timedelta(seconds=wait))
    except Exception as error:
        if group is not None:
            with contextlib.suppress(Exception):  # the error being raised is the one to tell
                group.abort()
        raise TransientSetupError(
            f"Epoch {formed.epoch}'s group could not be made (a member may be gone): {error}"
        ) from error
    log.info(
        "agang: elastic epoch %d of %s formed: rank %d of %d.",
        formed.epoch,
        formed.view.namespace,
        formed.rank,
        size,
    )
    return group
