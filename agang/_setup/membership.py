"""Who belongs to each epoch of an elastic gang: agreed through a store that outlives
every rank (``agang store``), with the epoch in every key.

Rules (all of it runs on a set-up thread, never on the loop):
1. *Formation 0* waits for ``WORLD_SIZE`` processes, or for the deadline with at least
   ``min_size``; ``RANK`` orders them. A process that comes after a formation closed is
   a *joiner*: it registers, and waits for the next reform. A joiner is *waiting* from
   its registration until a decision admits it or it gives up (``withdraw_joiner``), and
   waits again if it registers again (a member left behind by a decision comes back
   as a joiner, under the same id): registrations and their ends are counted per id.
2. *A reform* (epoch N) is joined by the members of epoch N-1 that call it and by the
   joiners waiting then. The members that have not arrived are pinged through their
   responders (``agang._setup.elastic.ping``): one that answers is alive and is
   waited for, until the deadline; one that does not (dead, stopped) is left out.
   Waiting joiners get a short grace to arrive, since they poll; none where the
   survivors alone fill ``max_size``, since none could be admitted. A joiner admitted
   into an epoch is no longer waiting, whether it lives on or dies: later reforms do
   not wait for it. Nor for a waiting joiner that died: one that waits beats
   (``say_waiting``, every ``JOINER_BEAT`` seconds, from before it registers), and a
   reform gives the grace only to a joiner this process has not seen silent for
   ``JOINER_STALE`` (``agang._membership.heartbeat``: a beat is a count, judged on
   this process's own monotonic clock, never by a wall clock read on another host).
   The watch lasts as long as the process, and starts when a member hears of a
   joiner (its notice), not at the next reform: a joiner that died while the gang
   trained is known silent by the time a reform decides, costs it nothing, and is
   withdrawn by that decision, so that no reform reads it again; so is a joiner that
   never beat. One that dies just before a reform costs that reform at most the grace
   (and the next, till it was seen silent for ``JOINER_STALE``). A clock that differs
   between hosts changes nothing.
3. *One decision.* Every old member that arrived decides on its own, from the store,
   when the formation is complete; the first to write the member list
   (``compare_set`` on an empty key) wins, and every process reads that list. The
   survivors keep their relative order, then the joiners in arrival order, up to
   ``max_size``. A process not on the list waits for the next epoch.
4. *At least ``min_size``.* A reform with fewer members than ``min_size`` (the
   survivors and the joiners that arrived, up to ``max_size``) is not complete: it
   waits for more, joiners included, until its deadline, and decides as soon as there
   are ``min_size``. Fewer at the deadline, for a reform or formation 0:
   ``GangInitError`` naming who is missing, raised then.
5. A member that dies after the decision makes the group's creation fail within the
   deadline; the caller then forms epoch N+1 with whoever is left (it never hangs).
6. *One job per store.* Formation 0's decision first names the job: a random id under
   ``job``, written once (``compare_set`` on an empty key), before the member list, so
   whoever reads the list finds the id. Members check it at each reform
   (``check_job``): a store that holds another id, or none, lost the job's state (it
   was restarted empty: a ``TCPStore`` keeps its keys in memory), and the reform fails,
   naming the store, instead of forming from nothing. A store that holds no job then
   is marked ``lost`` with the job's id and epoch, and no formation 0 starts on a
   store so marked: a replacement that came to the restarted store while the job's
   members lived fails, rather than form a second job beside them. One that comes
   before any member looked cannot know of them, and forms a job of its own; the old
   members fail at their next look, since that store holds another job's id.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from agang._errors import GangInitError
from agang._membership import store as stores
from agang._membership.heartbeat import Watch, write_beat
from agang._membership.member import Member
from agang._membership.roster import Roster
from agang._membership.roster import epoch_key as _epoch_key
from agang._validate import check_non_negative_int

#: How long a reform waits for registered joiners to arrive (they poll every _POLL).
JOINER_GRACE = 0.5
#: How often a waiting joiner beats, and how long this process must see its count not
#: change to take it for dead (rule 2): ten beats, so that a loaded machine's late
#: beats do not count a live joiner as dead.
JOINER_BEAT = 0.1
JOINER_STALE = 1.0
PING_SECONDS = 0.3
_REPING = 1.0
_POLL = 0.02
_ROOT = "agang/elastic"
#: Every joiner's registration, one line each; and the end of each (admitted by a
#: decision, or given up), one id a line (rule 1).
_JOINERS = f"{_ROOT}/joiners/list"
_ENDED = f"{_ROOT}/joiners/admitted"
#: Each waiting joiner's beat, under its id: a count (rule 2).
_BEATS = f"{_ROOT}/joiners/beat"
#: The job's id; and, on a store found without it by a member, what was lost (rule 6).
_JOB = f"{_ROOT}/job"
_LOST = f"{_ROOT}/lost"


def me(rank_hint: int) -> Member:
    """This process as a candidate member: its ``RANK`` (the order of formation 0) is
    its name."""
    return Member.me(str(rank_hint))


def rank_hint(member: Member) -> int:
    """A member's ``RANK`` at formation 0 (its name)."""
    return int(member.name)


def roster(store: Any) -> Roster:
    """The elastic gang's epochs on ``store``."""
    return Roster(store, _ROOT)


def epoch_key(epoch: int, name: str) -> str:
    return _epoch_key(_ROOT, epoch, name)


def current_epoch(store: Any) -> int | None:
    """The last epoch whose membership was decided, or None before formation 0's."""
    return roster(store).newest()


def job_of(store: Any) -> str | None:
    """The id of the job whose epochs ``store`` holds, or None before formation 0's
    decision (rule 6)."""
    return stores.read(store, _JOB)


def check_job(store: Any, job: str, epoch: int, where: str) -> None:
    """Raises ``GangInitError`` where ``store`` (at ``where``) no longer holds ``job``, of
    which this process is a member at ``epoch``; a store that holds no job is marked
    lost, so that no formation 0 starts on it (rule 6)."""
    if not isinstance(job, str) or not job:  # type: ignore[redundant-expr]  # untyped callers
        raise ValueError(f"`job` must be a job's id (a non-empty str), but is {job!r} instead.")
    check_non_negative_int(epoch, name="epoch")
    found = job_of(store)
    if found == job:
        return
    if found is None:
        what = f"job {job}, at epoch {epoch}, found the store at {where} without its state"
        store.compare_set(_LOST, "", what)
    since = "" if found is None else f"; it holds job {found}, formed on it since"
    raise GangInitError(
        f"The store at {where} no longer holds elastic job {job} (this member is at epoch "
        f"{epoch}): it lost the job's state (restarted empty?){since}. The job cannot "
        f"reform without it: start it again, on a new store."
    )


def _refuse_if_lost(store: Any) -> None:
    """Raises ``GangInitError`` where a running job's members found ``store`` without
    its state: a formation 0 here would run beside them (rule 6)."""
    lost = stores.read(store, _LOST)
    if lost is not None:
        raise GangInitError(
            f"This store lost the state of a running elastic job ({lost}): formation 0 "
            f"here would make a second job beside that one's members. Start a new "
            f"`agang store` for a new job."
        )


def members_of(store: Any, epoch: int) -> list[Member]:
    """The decided members of ``epoch``."""
    return roster(store).members(epoch) or []


def waiting_joiners(store: Any) -> set[str]:
    """The joiners waiting now: registered more times than admitted or given up (rule 1)."""
    return {c.uid for c in _waiting(store)}


def _waiting(store: Any) -> list[Member]:
    registrations = [Member.from_text(t) for t in stores.lines(store, _JOINERS)]
    ended = Counter(stores.lines(store, _ENDED))
    count = Counter(c.uid for c in registrations)
    return [c for c in _unique(registrations) if count[c.uid] > ended[c.uid]]


def register_joiner(store: Any, joiner: Member) -> None:
    store.append(_JOINERS, joiner.to_text() + "\n")


def withdraw_joiner(store: Any, joiner: Member) -> None:
    """Says that the joiner gave up (its deadline passed): no reform waits for it."""
    store.append(_ENDED, joiner.uid + "\n")


def say_waiting(store: Any, joiner: Member, count: int) -> None:
    """Beat ``count`` of the waiting ``joiner``: it is alive and waits (rule 2)."""
    write_beat(store, f"{_BEATS}/{joiner.uid}", count)


#: What this process saw of the joiners' beats, for every reform it takes part in
#: (rule 2): a joiner's silence is watched across reforms, never read off a clock.
_watch = Watch(JOINER_STALE)


def live_joiners(store: Any) -> set[str]:
    """The waiting joiners this process has not seen silent for ``JOINER_STALE``, as of
    one look now (rule 2)."""
    return {c.uid for c in _fresh(store, _waiting(store))[0]}


def look_at_joiners(store: Any, uids: set[str]) -> set[str]:
    """One look at the beats of the joiners ``uids`` (rule 2); those not seen silent.
    A member calls it while joiners wait (``agang._setup.elastic.watch_joiners``), so
    that a reform's decider knows of a joiner that died already, without waiting."""
    _watch.stale = JOINER_STALE  # read at each look: tests shorten it
    started = time.monotonic()
    beats = {uid: stores.read(store, f"{_BEATS}/{uid}") for uid in uids}
    ended = time.monotonic()
    _watch.look(beats, started, ended)
    return {
        uid for uid, beat in beats.items() if beat is not None and not _watch.is_silent(uid, ended)
    }


def _fresh(store: Any, joiners: list[Member]) -> tuple[list[Member], set[str]]:
    """Of ``joiners``, those not seen silent, and the uids of those seen silent (or that
    never beat), after one look at their beats (rule 2)."""
    alive_uids = look_at_joiners(store, {j.uid for j in joiners})
    alive = [j for j in joiners if j.uid in alive_uids]
    return alive, {j.uid for j in joiners} - alive_uids


def check_in(store: Any, epoch: int, member: Member) -> None:
    """Says that ``member`` starts making ``epoch``'s group (alive after the decision)."""
    roster(store).check_in(epoch, member.uid)


def say_closing(store: Any, epoch: int, member: Member) -> None:
    """Says that ``member``, decided a member of ``epoch``, is still closing its old
    gang: one beat of a count that goes up while it does."""
    store.add(epoch_key(epoch, f"closing/{member.uid}"), 1)


def closing_beats(store: Any, epoch: int, uid: str) -> int:
    """How many times the member ``uid`` said it is closing its old gang (``say_closing``)."""
    return int(store.add(epoch_key(epoch, f"closing/{uid}"), 0))


def checked_in(store: Any, epoch: int) -> set[str]:
    """The members that started making ``epoch``'s group."""
    return roster(store).checked_in(epoch)


def form(
    store: Any,
    me: Member,
    epoch: int,
    *,
    previous: list[Member] | None,
    target: int,
    min_size: int,
    max_size: int | None,
    deadline: float,
    alive: Callable[[list[int]], set[int]],
    cancelled: Callable[[], bool] = lambda: False,
) -> list[Member] | None:
    """Takes part in forming ``epoch``; returns its members, or None where this process
    is not among them (it arrived after the decision). ``previous`` is epoch-1's members
    (None for formation 0 and for a joiner); ``alive(indices)`` pings previous members
    by their rank in it (rule 2); ``target`` is formation 0's size."""
    epochs = roster(store)
    store.append(epoch_key(epoch, "arrived"), me.to_text() + "\n")
    decider = (previous is not None and any(c.uid == me.uid for c in previous)) or epoch == 0
    arrived_at = time.monotonic()
    dead: set[str] = set()
    gone_joiners: set[str] = set()  # seen silent, or never beat (rule 2)
    pinged_at = -float("inf")
    while True:
        if cancelled():
            raise TimeoutError("cancelled")
        if epoch == 0:
            _refuse_if_lost(store)  # rule 6
        members = epochs.members(epoch)
        if members is not None:
            return members if any(c.uid == me.uid for c in members) else None
        now = time.monotonic()
        if decider:
            arrived = _unique(
                Member.from_text(t) for t in stores.lines(store, epoch_key(epoch, "arrived"))
            )
            proposal: list[Member] | None = None
            gone: list[str] = []  # who is missing, should there be too few (rule 4)
            if previous is None:  # formation 0 (rule 1)
                if len(arrived) >= target or now >= deadline:
                    proposal = sorted(arrived, key=rank_hint)[:target]
                    ranks = {rank_hint(c) for c in arrived}
                    gone = [f"RANK {r}" for r in range(target) if r not in ranks]
            else:  # a reform (rule 2)
                here = {c.uid for c in arrived}
                missing = [
                    i for i, c in enumerate(previous) if c.uid not in here and c.uid not in dead
                ]
                if missing and now - pinged_at >= _REPING:
                    answered = alive(missing)
                    dead |= {previous[i].uid for i in missing if i not in answered}
                    pinged_at = time.monotonic()
                    missing = [i for i in missing if previous[i].uid not in dead]
                survivors = [c for c in previous if c.uid in here]
                newcomers = [c for c in arrived if c.uid not in {p.uid for p in previous}]
                joiners_in = (
                    (max_size is not None and len(survivors) >= max_size)
                    or now - arrived_at >= JOINER_GRACE
                    or not _grace_for(store, previous, here, gone_joiners)
                )
                enough = len(_capped(survivors + newcomers, max_size)) >= min_size  # rule 4
                if (not missing and joiners_in and enough) or now >= deadline:
                    proposal = survivors + newcomers
                    gone = [c.where for c in previous if c.uid not in here]
            if proposal is not None:
                proposal = _capped(proposal, max_size)
                if len(proposal) < min_size:  # only at the deadline (rule 4)
                    raise GangInitError(
                        f"Epoch {epoch} of the elastic gang has {len(proposal)} members at "
                        f"its deadline, fewer than min_size={min_size}; missing: "
                        f"{'; '.join(gone) or 'unknown'}."
                    )
                _decide(store, me, epoch, proposal, previous, gone_joiners)
                continue
        if now >= deadline + (0.0 if decider else 1.0):
            raise GangInitError(
                f"Epoch {epoch} of the elastic gang was not formed before the deadline "
                f"(this process: {me.where})."
            )
        time.sleep(_POLL)


def _grace_for(store: Any, previous: list[Member], here: set[str], gone: set[str]) -> list[Member]:
    """The registered joiners, not arrived, that a reform from ``previous`` still gives
    its grace to; adds those seen silent to ``gone`` (rule 2)."""
    joiners = [j for j in _registered_joiners(store, previous) if j.uid not in here]
    alive, silent = _fresh(store, joiners)
    gone |= silent
    gone -= {j.uid for j in alive}
    return alive


def _decide(
    store: Any,
    me: Member,
    epoch: int,
    proposal: list[Member],
    previous: list[Member] | None,
    gone: set[str],
) -> None:
    if epoch == 0:  # rule 6: named before any list can be read
        store.compare_set(_JOB, "", secrets.token_hex(8))
    epochs = roster(store)
    _, won = epochs.decide(epoch, proposal, by=me.uid)
    if won:  # rule 3
        # The waiting joiners it takes wait no more (rule 1); formation 0's members never
        # registered, so they are not counted as admitted (they may register later).
        waiting = waiting_joiners(store)
        old = {c.uid for c in previous or []}
        admitted = [c.uid for c in proposal if c.uid not in old and c.uid in waiting]
        # The dead joiners it saw wait no more either (rule 2): no later reform reads them.
        ended = admitted + sorted((gone & waiting) - set(admitted))
        if ended:
            store.append(_ENDED, "".join(f"{uid}\n" for uid in ended))
        epochs.publish(epoch)


def _registered_joiners(store: Any, previous: list[Member]) -> list[Member]:
    """The joiners a reform from ``previous`` gives a grace to arrive: those waiting now,
    not an admitted one that died since (rule 2)."""
    old = {c.uid for c in previous}
    return [c for c in _waiting(store) if c.uid not in old]


def _capped(candidates: list[Member], max_size: int | None) -> list[Member]:
    return candidates if max_size is None else candidates[:max_size]


def _unique(candidates: Any) -> list[Member]:
    seen: dict[str, Member] = {}
    for candidate in candidates:
        seen.setdefault(candidate.uid, candidate)
    return list(seen.values())
