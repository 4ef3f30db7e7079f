"""The elastic gang: a world gang that can be re-formed from its survivors and joiners.

Rules:
1. ``reform()`` decides the next epoch's members first, with this gang still open (its
   responder answers the other members' pings: alive), then closes this gang (its
   communicator aborted; saying meanwhile that it is closing, which may take seconds, so
   the others wait for it), then makes the new epoch's group. A group that cannot be made
   (a member died meanwhile) makes it form the epoch after, within the same deadline.
2. The new gang has its own communicator and sequence numbers and the same policies;
   lanes and sub-gangs are not carried over (make them again on the new gang).
3. ``waiting_to_join()`` reads a local count: a joiner tells each member's responder
   that it waits, so asking costs no store traffic and no collective. A reform forgets
   the notices it had: a joiner it did not admit tells the new epoch's members again
   once that epoch exists, and one that died never does, so it is not counted for ever.
   A gang made by ``init`` starts from the store's registrations instead, counting only
   the joiners still beating (``agang._setup.membership``, rule 2): a registration
   outlives a joiner killed while it waits.
   It counts only the joiners a reform could admit, up to ``max_size`` less the gang's
   size: none while the gang is at ``max_size``, or a loop that reforms when it is
   above 0 would reform at every step, admitting nobody.
4. A member that starts a reform tells every other member's responder, which breaks
   their gang at once: an op that waits on a dead peer's neighbour fails then, not at
   its deadline, so every member comes to the reform within moments of the first.
5. A member whose responder loses its store connection (the store stopped or was
   restarted: a restarted store holds none of the job's state) is out of reach: no
   ping, no reform notice gets to it, and the store may no longer hold the job. It
   breaks its gang at once, and ``waiting_to_join()`` raises that error, so the
   training loop's next op or step boundary fails, naming the store, rather than train
   on unaware; its ``reform()`` then finds whether the store still holds the job
   (``agang._setup.elastic``, rule 8).
6. *Death notices* (``agang._membership.deaths``, ``agang.report_death``): each
   member listens on its process's responder. A notice that names a member of this
   epoch breaks the gang at once, naming the member and the watcher's why, so that every
   op that waits on it fails now, not at its deadline; the next reform leaves it out
   without pinging it. A notice that names this member itself is logged and ignored.
7. *A private world* (``agang.ray``'s gangs): the same gang over groups registered
   nowhere, its keys under a namespace of the store, so that the process's default
   group, if it has one, stays its owner's, and gangs of one job share one store.
   It answers blame as a world does (its ranks are the process's world ranks), and
   a process has one world gang, private or not. c10d makes sub-groups only of its
   default group: a private world has no sub-gangs or lanes.
8. *A watcher's word over a dropped connection.* Where a watcher reports the members'
   deaths (``expect_death_notices``: agang.ray's keeper), an op that failed on a lost
   connection waits up to ``DEATH_NOTICE_SECONDS`` (off the loop) for the notice
   naming who died, and says that instead: the transport's "Connection closed by
   peer" and the watcher's notice come tens of milliseconds apart, in either order,
   and only the notice says who and why. The wait is the gang's, once: ops that fail
   after the first wait only what is left of it. Without a watcher nothing waits.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from typing_extensions import override

from agang._backends.c10d import mailbox
from agang._backends.c10d.backend import C10dBackend, backstop_for
from agang._backends.c10d.retry import TransientSetupError
from agang._collective.process_group_gang import ProcessGroupGang
from agang._errors import GangBrokenError, GangInitError, one_line
from agang._membership import deaths
from agang._policy import GangPolicy
from agang._runtime.threads import run_blocking
from agang._setup import elastic as elastic_setup
from agang._setup import membership
from agang._setup.env import WorldInfo
from agang._setup.epoch_gang import gloo_group
from agang._validate import check_deadline

log = logging.getLogger("agang.setup")

#: A reform's deadline when ``reform()`` is given none (seconds).
DEFAULT_REFORM_TIMEOUT = 60.0
#: How long after the deadline a reform's step is given up on (seconds).
_STEP_MARGIN = 2.0


class ElasticGang(ProcessGroupGang):
    """The gang [`agang.init`][agang.init] returns with ``elastic=``: one epoch of an elastic gang.

    Use it like any gang; after a failure (or to admit joiners) every surviving member
    calls [`reform`][agang.ElasticGang.reform], which returns the next epoch's gang.
    """

    def __init__(
        self,
        formed: elastic_setup.Formed,
        *,
        elastic: elastic_setup.Elastic,
        backend: str,
        device: torch.device,
        policy: GangPolicy,
        stream_ordered: bool,
        waiting: set[str],
        deadline: float,
        group: dist.ProcessGroup | None = None,
        name: str = "root",
    ) -> None:
        # Order checks' side channel, made by every member (a collective call), by the
        # formation's deadline rather than c10d's default of 30 minutes.
        side_seconds = max(1.0, deadline - time.monotonic())
        side: dist.ProcessGroup | None = None
        try:
            if policy.check_order:
                side = (
                    dist.new_group(backend="gloo", timeout=timedelta(seconds=side_seconds))
                    if group is None
                    else _private_side_group(formed, side_seconds)
                )
            super().__init__(
                dist.distributed_c10d._get_default_group() if group is None else group,
                device=device,
                backend=backend,
                name=name,
                policy=policy,
                is_world=True,
                stream_ordered=stream_ordered,
                order_group=side,
                registered=group is None,  # rule 7: a private world's is registered nowhere
            )
        except BaseException:
            _abort_quietly(group)  # rule 7: made for this gang, which no one will release
            raise
        self._formed = formed
        self._elastic = elastic
        self._settings: dict[str, Any] = {
            "backend": backend,
            "device": device,
            "policy": policy,
            "stream_ordered": stream_ordered,
            "name": name,
        }
        self._private = group is not None
        self._heard: dict[int, str] = {}  # rule 8: per rank, the notice that named it
        self._heard_news = threading.Condition()
        self._hear_until: float | None = None  # rule 8: one wait per gang, not per op
        self._expects_notices = False  # rule 8; carried to the next epoch's gang
        self._waiting = set(waiting)
        self._lost: GangBrokenError | None = None  # rule 5
        # Rules 4, 5: this process's mailbox tells the newest epoch's gang (this one).
        mailbox.register("reforming", self._another_member_reforms)
        mailbox.on_connection_lost(self._store_lost)
        # Membership rule 2: the joiners it hears of are watched from then on.
        elastic_setup.watch_joiners(formed.store, lambda: not self.closed)
        self._listening = self._listen()

    def _listen(self) -> deaths.Listening | None:
        """Rule 6: this member hears death notices on its process's responder."""
        responder = mailbox.current()
        if responder is None:  # no store to answer on: nothing can reach it either
            return None
        view = self._formed.view
        prefix = view.full_key(membership.epoch_key(self._formed.epoch, "blame"))
        return deaths.Listening(
            view.root, prefix, responder.world_rank, self._member_gone, responder
        )

    def _member_gone(self, notice: deaths.Notice) -> None:
        """A death notice (rule 6), on the responder's thread."""
        me = self._formed.me
        if notice.names(me.uid, me.where):
            log.warning(
                "agang: a death notice names this member (%s), which is alive: %s.",
                me.where,
                notice.describe(),
            )
            return
        gone = [m for m in self._formed.members if notice.names(m.uid, m.where)]
        if not gone:
            return
        elastic_setup.say_dead({m.uid for m in gone})
        with self._heard_news:  # rule 8
            for member in gone:
                rank = self._formed.members.index(member)
                self._heard[rank] = f"rank {rank} ({member.where}) was {notice.describe()}"
            self._heard_news.notify_all()
        ranks = ", ".join(f"rank {self._formed.members.index(m)} ({m.where})" for m in gone)
        cause = GangBrokenError(
            f"Gang '{self.name}' (epoch {self.epoch}) lost {ranks}: {notice.describe()}. "
            f"Call reform() to go on without it.",
            None,
        )
        self._engine.break_gang(cause)

    def _expect_notices(self) -> None:
        """Rule 8: a watcher reports this gang's members' deaths."""
        self._expects_notices = True
        backend = self._backend
        assert isinstance(backend, C10dBackend)
        backend.hear_deaths(self._deaths_heard)

    def _deaths_heard(self, seconds: float) -> str:
        """What death notices said of this gang's members, waited for up to ``seconds``
        (rule 8); "" for nothing."""
        with self._heard_news:
            if self._hear_until is None and seconds > 0:  # the first lost op off the loop
                self._hear_until = time.monotonic() + seconds  # waits; the others, no longer
            until = self._hear_until or 0.0
            left = max(0.0, min(seconds, until - time.monotonic()))
            self._heard_news.wait_for(lambda: bool(self._heard), timeout=left)
            return "; ".join(text for _, text in sorted(self._heard.items()))

    @override
    async def close(self) -> None:
        """Closes this epoch's gang ([`agang.Gang.close`][agang.Gang.close]), and stops hearing
        death notices for it."""
        await super().close()
        await run_blocking(self._stop_listening, name="stop listening", seconds=5.0)

    @override
    def close_sync(self) -> None:
        """[`close`][agang.ElasticGang.close] for synchronous code."""
        super().close_sync()
        self._stop_listening()

    def _stop_listening(self) -> None:
        listening, self._listening = self._listening, None
        if listening is not None:
            listening.stop()

    def _another_member_reforms(self, responder: mailbox.Responder, text: str) -> None:
        """A member started the next epoch: ops pending here will never finish (rule 4).
        ``text`` says which epoch, started by whom."""
        cause = GangBrokenError(
            f"Gang '{self.name}' (epoch {self.epoch}) was left by its peers: epoch {text} "
            f"started. Call reform() to join it.",
            None,
        )
        self._engine.break_gang(cause)

    def _store_lost(self, error: BaseException) -> None:
        """The responder's store connection failed with ``error`` (rule 5)."""
        where = self._formed.world.store_address
        cause = GangBrokenError(
            f"Gang '{self.name}' (epoch {self.epoch}) lost its connection to the store at "
            f"{where} ({one_line(error).rstrip('.')}): the store stopped, or was restarted, "
            f"and a restarted store holds none of the job's state. Call reform(): it goes "
            f"on if the store still holds the job, and fails saying so if not.",
            None,
        )
        self._lost = cause
        self._engine.break_gang(cause)

    @property
    def epoch(self) -> int:
        """0 for the first formation, one more at each reform."""
        return self._formed.epoch

    def waiting_to_join(self) -> int:
        """How many of the processes waiting to join the next reform would admit: no
        more than ``max_size`` less this gang's size (rule 3: local, no I/O).

        Raises:
            GangBrokenError: This member lost its connection to the store (rule 5).
        """
        if self._lost is not None:
            raise GangBrokenError(str(self._lost), self._lost)
        admitted = {c.uid for c in self._formed.members}
        waiting = len((self._waiting | elastic_setup.noticed()) - admitted)
        if self._elastic.max_size is None:
            return waiting
        return min(waiting, max(0, self._elastic.max_size - len(self._formed.members)))

    # The reform's deadline is part of its contract, as init's is (not a cancel scope).
    async def reform(self, timeout: float | None = None) -> ElasticGang:  # noqa: ASYNC109
        """The next epoch's gang: this one's live members that call reform, plus the
        joiners waiting then, up to ``max_size`` (see the module's rules). With fewer
        than ``min_size``, it waits for more, joiners included, until its deadline.
        Call it on every member.

        Args:
            timeout: The reform's deadline in seconds (None: 60 s; ``math.inf``: none,
                waiting for ``min_size`` members as long as it takes).

        Raises:
            GangInitError: Fewer than ``min_size`` members came within the deadline (the
                message names who is missing), or no group could be made in time, or
                the store did not answer, or no longer holds the job (restarted empty).
        """
        # agang's one rule for a timeout (the weights' too): None is the default, and
        # math.inf none, which c10d's timedeltas take as the backstop behind an op with
        # no deadline.
        seconds = check_deadline(timeout, name="timeout", default=DEFAULT_REFORM_TIMEOUT)
        deadline = time.monotonic() + (backstop_for(None) if seconds is None else seconds)
        elastic_setup.forget_noticed()  # rule 3: the joiners still waiting say so again
        formed = await self._blocking(
            lambda: elastic_setup.reform_membership(self._formed, self._elastic, deadline), deadline
        )
        with elastic_setup.closing(formed):  # rule 1: the others wait for a member that closes
            await self.close()
        backend, device = self._settings["backend"], self._settings["device"]
        make = functools.partial(
            elastic_setup.make_group, backend=backend, device=device, private=self._private
        )
        while True:
            try:
                group = await self._blocking(
                    functools.partial(make, formed, deadline=deadline), deadline
                )
                break
            except TransientSetupError as error:
                if time.monotonic() >= deadline:
                    raise GangInitError(
                        f"No group of epoch {formed.epoch} was made before the reform's "
                        f"deadline: {error}"
                    ) from error
                formed = await self._blocking(
                    functools.partial(
                        elastic_setup.reform_membership, formed, self._elastic, deadline, made=False
                    ),
                    deadline,
                )
        # Made on a thread, as init makes it: its responder connects to the store (a
        # network round trip), which must not hold the event loop.
        waiting = elastic_setup.noticed()  # rule 3: only notices since this reform began
        gang: ElasticGang = await self._blocking(
            lambda: ElasticGang(
                formed,
                elastic=self._elastic,
                waiting=waiting,
                deadline=deadline,
                group=group,
                **self._settings,
            ),
            deadline,
        )
        if self._expects_notices:  # rule 8: the watcher still watches every member
            gang._expect_notices()
        return gang

    async def _blocking(self, fn: Any, deadline: float) -> Any:
        # The steps end by the deadline on their own, some a moment after it (a joiner
        # waits a second for a late decision): the margin is for those, not a wait.
        boxed = await run_blocking(
            lambda: (fn(),),
            name="elastic reform",
            seconds=max(0.1, deadline - time.monotonic()) + _STEP_MARGIN,
        )
        if boxed is None:
            raise GangInitError(
                f"The reform did not finish before its deadline: a step was still blocked "
                f"{_STEP_MARGIN:g} s after it. The calls that block so are those to the "
                f"store at {self._formed.world.store_address}, once it stops answering "
                f"(a stopped store process, or this member cut off from it)."
            )
        return boxed[0]


class Plan(Protocol):
    """What ``form_first`` reads of init's plan (``agang._setup.init._Plan``), which
    cannot be named here: init imports this module."""

    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def policy(self) -> GangPolicy: ...
    @property
    def stream_ordered(self) -> bool: ...


def form_first(
    plan: Plan,
    world: WorldInfo,
    elastic: elastic_setup.Elastic,
    deadline: float,
    *,
    namespace: str = "",
    name: str = "root",
) -> ElasticGang:
    """``agang.init(elastic=...)``'s set-up (on its thread): formation 0, or the next
    reform as a joiner; a group that cannot be made is formed again (rule 1). With a
    ``namespace``, a private world under that prefix of the store (rule 7)."""
    view = elastic_setup.connect_store(world, deadline, namespace)
    formed = elastic_setup.first_formation(view, world, elastic, deadline)
    private = bool(namespace)
    while True:
        try:
            group = elastic_setup.make_group(
                formed, plan.backend, deadline, plan.device, private=private
            )
            break
        except TransientSetupError as error:
            if time.monotonic() >= deadline:
                raise GangInitError(
                    f"No elastic group was made before the deadline: {error}"
                ) from error
            formed = elastic_setup.reform_membership(formed, elastic, deadline, made=False)
    return ElasticGang(
        formed,
        elastic=elastic,
        backend=plan.backend,
        device=plan.device,
        policy=plan.policy,
        stream_ordered=plan.stream_ordered,
        # Registered and still beating: a joiner that died waiting is not counted.
        waiting=membership.live_joiners(view.store),
        deadline=deadline,
        group=group,
        name=name,
    )


def _abort_quietly(group: dist.ProcessGroup | None) -> None:
    """Aborts a private world's group that no gang took (rule 7); the default group
    is left to the error's handling, as before."""
    if group is not None:
        try:
            group.abort()
        except Exception:  # the error being raised is the one to tell
            log.debug("agang: a private group could not be aborted.", exc_info=True)


def _private_side_group(formed: elastic_setup.Formed, seconds: float) -> dist.ProcessGroup:
    """A private world's side Gloo group of order checks, beside its group (rule 7)."""
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        membership.epoch_key(formed.epoch, "order"), formed.store
    )
    return gloo_group(
        store,
        formed.rank,
        len(formed.members),
        timedelta(seconds=seconds),
        formed.world.master_addr,
        elastic_setup.private_name(formed, "/order"),
    )


def expect_death_notices(gang: ElasticGang) -> None:
    """Says that a watcher reports ``gang``'s members' deaths (rule 8)."""
    gang._expect_notices()
