"""The server's side: ``WeightSubscriber``.

Rules:
1. ``open`` connects to the store, waits (within its timeout) for the channel's plan,
   and refuses tensors whose plan differs, naming the first differing tensor on both
   sides; then it registers, and the service (``agang._weights.service``) takes part
   in every round from the next push on, on a thread of its own.
2. ``receive`` returns the next version newer than the last it returned, once the
   user's tensors hold it: by default it copies the staging buffers into them (the
   staging costs one extra copy of the model's bytes); opened ``in_place=True``, the
   rounds write the user's tensors themselves (a request served during a push may read
   a mix of two versions: for servers that pause serving during an update), and
   ``receive`` only says which version they hold.
3. A subscriber that can take no more versions (the publisher closed, went away or
   was replaced, the store went away for longer than its timeout, another subscriber
   of its name replaced it) makes ``receive`` raise ``GangError`` saying which; a
   ``GangClosedError`` where the publisher closed the channel, a normal end.
4. *Cancellation.* A ``receive`` cancelled while it copies a version into the tensors
   finishes the copy first (a copy takes milliseconds; half of one would leave the
   tensors holding two versions), and the version it copied is not lost: until a
   ``receive`` has returned it, the next one returns it at once (``version`` says what
   the tensors hold all along).
5. *A sharded server* (``open(..., gang=)``): every rank of the server's gang opens;
   each holds its slice of each tensor (``DTensor``s on a 1-D mesh of the gang,
   ``agang.Sharded``, or plain ones held whole) and stages only that. Rank 0 is the
   channel's one member, and relays each version's shares to the other ranks
   (``agang._weights.relay``, ``agang._weights.relayed``); the channel's plan must be
   split (a sharded trainer's), else every rank refuses it at ``open``. ``receive``
   is collective over a lane of the gang (``agree``): it returns a version once every
   rank holds it whole, and a rank that fails makes every rank's ``receive`` raise,
   naming it. A ``receive`` cancelled or timed out while it waited for the other
   ranks leaves its op for the next one to take up, so the lane stays in step.
6. *A sharded server's open ends the same on every rank.* Rank 0 tells the others the
   channel's plan, or why it found none, and then, once it joined the channel (or
   failed to: the store refused, its service could not start, it was cancelled),
   whether it did: every rank returns, or every rank raises the same
   ``GangInitError`` naming rank 0 and why (a rank > 0 that returned alone would wait
   for rounds that never come). The other ranks wait for rank 0 as long as ``timeout``
   lets rank 0 wait (``over_gang.following_bound``; ``math.inf``: until rank 0 says,
   or the lane fails: rank 0 lost). Every rank's name is rank 0's, the channel's
   member's (the one given, else rank 0's ``HOST:PID``); messages add the rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import anyio.lowlevel
import torch

from agang._errors import GangClosedError, GangError, GangInitError, one_line
from agang._gang import Gang
from agang._membership.gangs import GangFactory
from agang._membership.member import Member
from agang._runtime.threads import run_blocking
from agang._weights import channel as channel_keys
from agang._weights import checks, over_gang
from agang._weights.blocking import blocking, run_sync
from agang._weights.buckets import Buckets
from agang._weights.channel import Channel
from agang._weights.plan import Plan
from agang._weights.relay import Relay
from agang._weights.relayed import Relayed
from agang._weights.server_rank import ServerRank
from agang._weights.service import Service
from agang._weights.site import Site
from agang._weights.upstream import Upstream

_PLAN_POLL = 0.05
#: How long rank 0 takes to tell the other ranks that its ``open`` failed (rule 6).
_TELL_SECONDS = 5.0
_SEEN_POLL = 0.01
#: The most staging bytes ``receive`` copies on the caller's loop (about 0.1 ms here).
INLINE_TAKE_BYTES = 1 << 20


def default_name() -> str:
    """A subscriber's name where ``open`` was given none: ``HOST:PID``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class WeightSubscriber:
    """Receives the versions a [`agang.WeightPublisher`][agang.WeightPublisher] pushes on a channel.
    Open it with [`open`][agang.WeightSubscriber.open].

    Example:
        <!-- not-run: needs an agang store and a publisher on another machine -->
        ```python
        subscriber = await agang.WeightSubscriber.open(model.state_dict(),
            store="10.0.0.1:29500", channel="policy")
        version = await subscriber.receive()   # model now holds it
        ```
    """

    def __init__(
        self,
        channel: Channel,
        tensors: dict[str, torch.Tensor],
        plan: Plan,
        name: str,
        timeout: float | None,
        in_place: bool,
        factory: GangFactory,
        connect: Callable[[float], Any],
        relay: Relay | None = None,
    ) -> None:
        self._me = Member.me(name)
        self._channel = channel
        self._tensors = tensors
        self._buckets = (
            None if relay else Buckets(plan, tensors, publisher=False, in_place=in_place)
        )
        self._version: int | None = None  # what the tensors hold
        self._returned: int | None = None  # what a receive returned last (rule 4)
        self._closed = False
        self._over: ServerRank | None = None  # a sharded server's rank (rule 5)
        self._responder = channel.serve_status(self._me.uid, self._status)
        self._upstream = Upstream(channel, self._me, timeout, connect, self._serve_again)
        try:
            self._registration = channel.register(self._me)  # before open returns
            self._service = Service(
                channel, self._buckets, self._me, timeout, self._upstream, factory, relay
            )
        except BaseException:  # the store refused: no thread of it stays behind
            self._upstream.stop()
            self._responder.stop()
            raise

    def _status(self) -> str:
        return self._service.status

    def _serve_again(self) -> None:
        """The store is reached again on a new connection: the status responder too."""
        self._responder.stop(seconds=0.0)  # its connection is gone, or going
        self._responder = self._channel.serve_status(self._me.uid, self._status)

    @classmethod
    async def open(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        name: str | None = None,
        timeout: float | None = 60.0,  # noqa: ASYNC109  # the deadline of open and of a round
        in_place: bool = False,
        secret: str | bytes | None = None,
        gang: Gang | None = None,
    ) -> WeightSubscriber:
        """Joins ``channel`` on the ``agang store`` at ``store``; admitted at the next push.

        Args:
            tensors: Names to contiguous CPU tensors (a ``state_dict()``), the same names,
                order, shapes and dtypes as the publisher's (tied where the publisher's
                are, or not at all).
            store: The store's "HOST:PORT".
            channel: The channel's name.
            name: This subscriber's name in reports (None: "host:pid"; on a sharded
                server, rank 0's). A subscriber that opens with the name of an
                admitted one replaces it.
            timeout: Seconds ``open`` waits for the store and the publisher's plan, a
                round may take on this side once it began, and the store may be gone
                before the subscriber gives up (None: 60 s; ``math.inf``: no bound,
                ``open`` waiting for a publisher as long as it takes).
            in_place: Rounds write ``tensors`` themselves (no staging copy; rule 2).
            secret: The channel's secret, as the publisher was given it (None: none).
            gang: A sharded server's gang (module rule 5): every rank opens, with its
                slices (``DTensor``s on a 1-D mesh of the gang, ``agang.Sharded``, or
                plain tensors held whole); ``open`` and ``receive`` are collective.

        Raises:
            ValueError: ``tensors`` differ from the publisher's plan (the message names
                the first differing tensor on both sides), or an argument is invalid.
            GangInitError: The store did not answer, or no publisher opened the channel,
                before the deadline.
        """
        if gang is not None:  # every check on every rank, agreed (rule 5)
            return await cls._open_over(
                over_gang.check_gang(gang), tensors, store, channel, name, timeout,
                in_place, secret,
            )  # fmt: skip
        host, port = checks.check_store(store)
        channel_name = checks.check_channel(channel)
        named = checks.check_name(name) or default_name()
        seconds = checks.check_deadline(timeout, default=60.0)
        in_place = checks.check_bool(in_place, name="in_place")
        key = checks.check_secret(secret)
        checked = checks.check_tensors(tensors)
        device = checks.device_of(checked)
        site = Site.of(store, host, port, channel_name, f"subscriber '{named}'", device)
        return await cls._open(checked, channel_name, named, seconds, in_place, key, site)

    @classmethod
    async def _open(
        cls,
        tensors: dict[str, torch.Tensor],
        channel: str,
        name: str,
        seconds: float | None,
        in_place: bool,
        secret: bytes | None,
        site: Site,
    ) -> WeightSubscriber:
        """``open`` past its checks, on ``site`` (agang's tests give one of their own)."""
        found, theirs, deadline, given_up = await cls._find(channel, seconds, secret, site)
        refusal = cls._refusal(Plan.of(tensors, theirs.bucket_bytes, site.transport), theirs)
        if refusal is not None:
            raise ValueError(
                f"`tensors` {refusal} (channel '{channel}', published by "
                f"{found.publisher()}). Subscriber '{name}' was refused."
            )
        subscriber = cls(
            found, tensors, theirs, name, seconds, in_place, site.factory, site.connect
        )
        await subscriber._seen(deadline, given_up)
        return subscriber

    @classmethod
    async def _open_over(
        cls,
        gang: Gang,
        tensors: object,
        store: object,
        channel: object,
        name: object,
        timeout: object,  # noqa: ASYNC109  # open's, checked here
        in_place: object,
        secret: object,
        site_of: Callable[[torch.device], Site] | None = None,
    ) -> WeightSubscriber:
        """``open`` over a server's gang (rule 5): every rank checks its slices, rank 0
        finds the channel's plan and tells the others, every rank agrees on the verdict,
        then rank 0 joins the channel and the others follow it."""
        refused: str | None = None
        layouts: list[Any] = []
        local: dict[str, torch.Tensor] = {}
        site: Site | None = None
        given, channel, name = name, str(channel), str(name)  # for messages until checked
        seconds: float | None = 60.0
        key: bytes | None = None
        placed = False
        try:
            name = checks.check_name(given) or default_name()  # None: not "None"
            placed = checks.check_bool(in_place, name="in_place")
            who = f"subscriber '{name}'"
            inputs = over_gang.check_inputs(
                gang, tensors, store, channel, timeout, secret, who, site_of, 60.0
            )
            channel, seconds, key, site = inputs.channel, inputs.seconds, inputs.key, inputs.site
            layouts, local = inputs.layouts, inputs.local
        except (TypeError, ValueError) as error:
            refused = str(error)
        open_for = 60.0 if seconds is None else seconds
        who = f"subscriber '{name}'"
        relay_lane, agree = await over_gang.lanes(gang, channel, 2, open_for, who)
        # The inputs first, agreed before rank 0 goes to the store (over_gang rule 1).
        verdicts = await agree.all_gather_objects(refused, timeout=seconds)
        for rank, verdict in enumerate(verdicts):
            if verdict is not None:
                raise ValueError(f"Rank {rank} of the gang '{agree.name}' was refused: {verdict}")
        said: list[Any] = [None, None, name]  # the plan's text, or why none came; the name
        follow = math.inf if seconds is None else over_gang.following_bound(seconds)
        opened: tuple[Channel, Plan, float, threading.Event] | None = None
        if gang.rank == 0 and site is not None:
            try:
                opened = await cls._find(channel, seconds, key, site)
                said[0] = opened[1].to_text()
            except Exception as error:
                said[1] = one_line(error)
            except BaseException:  # cancelled: the others are told (rule 6)
                with anyio.CancelScope(shield=True), contextlib.suppress(GangError):
                    said[1] = "its open was cancelled"
                    await agree.broadcast_objects(said, 0, timeout=_TELL_SECONDS)
                raise
        await agree.broadcast_objects(said, 0, timeout=follow)
        if said[1] is not None:
            raise GangInitError(f"Server rank 0 found no plan: {said[1]}")
        name = str(said[2])  # rank 0's, the channel's member's (rule 6)
        plan: Plan | None = None
        if refused is None and site is not None and said[0] is not None:
            theirs = Plan.from_text(said[0])
            plan = over_gang.plan_of(list(local), layouts, theirs.bucket_bytes, site.transport)
            refusal = cls._refusal(plan, theirs, split=True)
            refused = None if refusal is None else f"`tensors` {refusal}"
        await over_gang.agree(agree, refused, plan, layouts, seconds)
        assert plan is not None
        assert site is not None
        assert said[0] is not None
        theirs = Plan.from_text(said[0])
        staging = {k: v if placed else torch.zeros_like(v) for k, v in local.items()}
        staged = [
            dataclasses.replace(layout, local=staging[k])
            for k, layout in zip(local, layouts, strict=True)
        ]
        failed = f"Server rank 0 of the gang '{gang.name}' could not open subscriber '{name}'"
        outcome: list[Any] = [None]  # why rank 0 could not join the channel (rule 6)
        if gang.rank != 0:
            made = cls.__new__(cls)
            made._me = Member.me(name)
            made._tensors = local
            made._buckets = None
            made._version = made._returned = None
            made._closed = False
            # Its rounds wait on the lane before rank 0 says: a push may follow at once.
            relayed = Relayed(theirs, staged, relay_lane, name, seconds)
            made._over = ServerRank(agree, relayed, staging, local, theirs.ties(), placed, name)
            told = False
            try:
                await agree.broadcast_objects(outcome, 0, timeout=follow)
                told = True
            except GangError as error:  # rank 0 lost (its lane failed), or too slow
                outcome[0] = f"it did not say whether it joined ({one_line(error)})"
            finally:
                if not told or outcome[0] is not None:  # failed or cancelled: nothing stays
                    with anyio.CancelScope(shield=True):
                        await run_blocking(made._over.stop, name="weights: close", seconds=10.0)
            if outcome[0] is not None:
                raise GangInitError(f"{failed}: {outcome[0]}")
            return made
        assert opened is not None
        found, _, deadline, given_up = opened
        try:
            relay = Relay(theirs, staged, relay_lane, gang.size)
            made = cls(
                found, local, theirs, name, seconds, placed, site.factory, site.connect, relay
            )
            await made._seen(deadline, given_up)  # cancelled: it closes, the agree lane stays
        except BaseException as error:
            why = one_line(error) if isinstance(error, Exception) else "it was cancelled"
            with anyio.CancelScope(shield=True), contextlib.suppress(GangError):
                outcome[0] = f"{type(error).__name__}: {why}"
                await agree.broadcast_objects(outcome, 0, timeout=_TELL_SECONDS)
            relay_lane.close_sync()
            agree.close_sync()
            if isinstance(error, Exception):
                raise GangInitError(f"{failed}: {outcome[0]}") from error
            raise
        made._over = ServerRank(
            agree, made._service, staging, local, theirs.ties(), placed, name, relay
        )
        try:
            await agree.broadcast_objects(outcome, 0, timeout=seconds)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await made.close()
            raise
        return made

    @staticmethod
    def _refusal(mine: Plan, theirs: Plan, *, split: bool = False) -> str | None:
        """Why a side whose plan is ``mine`` cannot take the channel's ``theirs``
        (plan rules 2, 5; rule 5 here where ``split``), or None."""
        if mine.transport != theirs.transport:  # plan rule 5
            return (
                f"are where the channel cannot carry them: its publisher moves them over "
                f"{theirs.transport}, and tensors here move over {mine.transport}. Both "
                f"sides of a channel must hold their tensors where one transport reaches "
                f"them (GPUs: NCCL; CPUs: Gloo)"
            )
        difference = mine.difference(theirs)
        if difference is not None:
            return f"do not match the channel's plan: {difference}"
        if split and not theirs.split:
            return (
                "are a sharded server's, and the channel's plan is not split (its "
                "publisher is not a sharded trainer): its direct buckets are whole "
                "tensors, which a server rank would have to hold whole. Subscribe whole, "
                "or publish from a sharded trainer (WeightPublisher.open(..., gang=))"
            )
        return None

    async def _seen(self, deadline: float, given_up: threading.Event) -> None:
        """Waits until the publisher saw this registration; cancelled, closes."""
        try:
            await blocking(
                functools.partial(self._wait_until_seen, deadline, given_up),
                2 * channel_keys.STALE + 2.0,
                what="the publisher's sight of this subscriber",
                store=self._channel.address,
            )
        except BaseException:  # cancelled: nothing of it may stay behind
            given_up.set()
            with anyio.CancelScope(shield=True):
                await self.close()
            raise

    @classmethod
    async def _find(
        cls, channel: str, seconds: float | None, secret: bytes | None, site: Site
    ) -> tuple[Channel, Plan, float, threading.Event]:
        """The channel and its plan, once a publisher wrote it (rule 1)."""
        deadline = time.monotonic() + (math.inf if seconds is None else seconds)
        connect_for = 60.0 if seconds is None else seconds
        given_up = threading.Event()  # set when ``open`` is cancelled: its threads end

        def find() -> tuple[Channel, Plan]:
            client = site.connect(time.monotonic() + connect_for)
            while True:
                found = Channel.find(client, channel, site.address, secret)
                text = None if found is None else found.plan_text()
                if found is not None and text is not None:
                    return found, Plan.from_text(text)
                if time.monotonic() >= deadline or given_up.is_set():
                    mismatch = Channel.secret_mismatch(client, channel, secret)
                    if mismatch is not None:
                        raise GangInitError(
                            f"The weights channel '{channel}' on the store at {site.address} "
                            f"could not be opened: {mismatch}. Give every side the "
                            f"publisher's `secret`."
                        )
                    raise GangInitError(
                        f"No publisher opened the channel '{channel}' on the store at "
                        f"{site.address} within {seconds:g} s."
                    )
                time.sleep(_PLAN_POLL)

        try:
            found, theirs = await blocking(
                find,
                math.inf if seconds is None else seconds + 2.0,
                what=f"finding the channel '{channel}'",
                store=site.address,
            )
        except BaseException:
            given_up.set()
            raise
        return found, theirs, deadline, given_up

    def _wait_until_seen(self, deadline: float, given_up: threading.Event) -> None:
        """Waits until the publisher saw this registration (its beat says so within
        ``BEAT`` s), so that a push that begins after ``open`` returns admits it
        (``agang._weights.channel`` rule 2). A publisher that does not beat (stopped,
        gone) is not waited for past ``2 * STALE`` s: the service finds out what it is."""
        give_up_at = min(deadline, time.monotonic() + 2 * channel_keys.STALE)
        while self._channel.seen() < self._registration and time.monotonic() < give_up_at:
            if given_up.wait(_SEEN_POLL):
                return

    @classmethod
    def open_sync(
        cls,
        tensors: Mapping[str, torch.Tensor],
        *,
        store: str,
        channel: str,
        name: str | None = None,
        timeout: float | None = 60.0,
        in_place: bool = False,
        secret: str | bytes | None = None,
        gang: Gang | None = None,
    ) -> WeightSubscriber:
        """[`open`][agang.WeightSubscriber.open] for programs without an event loop."""
        return run_sync(  # type: ignore[no-any-return]
            functools.partial(
                cls.open,
                tensors,
                store=store,
                channel=channel,
                name=name,
                timeout=timeout,
                in_place=in_place,
                secret=secret,
                gang=gang,
            )
        )

    @property
    def name(self) -> str:
        """This subscriber's name on the channel: the one given to ``open``, else ``HOST:PID``."""
        return self._me.name

    @property
    def version(self) -> int | None:
        """The version the tensors hold (the last ``receive`` returned), None before."""
        return self._version

    @property
    def staging_bytes(self) -> int:
        """The memory this subscriber holds beyond the user's tensors (rule 2); on a
        sharded server's rank, its slice's staging, and on rank 0 the relay's buffers
        (rule 5)."""
        if self._over is not None:
            return self._over.staging_bytes
        assert self._buckets is not None
        return self._buckets.staging_bytes + self._buckets.spare0.numel()

    async def receive(self, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """Waits for a version newer than [`version`][agang.WeightSubscriber.version], puts it in
        the tensors (rule 2) and returns it.

        The copy into the tensors happens during this call (for a model of more than
        ``INLINE_TAKE_BYTES``, on a worker thread while the event loop runs on): code
        that reads the same tensors while ``receive`` is pending may see parts of two
        versions. Call it where nothing reads them (between requests), or serve from a
        copy of your own that you swap in once it returns.

        Args:
            timeout: Seconds to wait; None: no bound.

        Raises:
            TimeoutError: No newer version came in time (the message says where the
                subscriber stands and when the publisher last beat).
            GangClosedError: The publisher closed the channel (a normal end), or this
                subscriber is closed.
            GangError: The subscriber can take no more versions (rule 3).
        """
        seconds = checks.check_deadline(timeout)
        deadline = time.monotonic() + (math.inf if seconds is None else seconds)
        if self._over is not None:  # rule 5
            if self._closed:
                raise GangClosedError(f"Subscriber '{self.name}' is closed.")
            if self._version is not None and self._version != self._returned:
                self._returned = self._version  # rule 4
                return self._version
            taken = await self._over.next_version(
                self._version, deadline, functools.partial(self._timed_out, seconds)
            )
            self._version = self._returned = taken
            return taken
        for _ in range(1_000_000):  # each pass waits for news, or ends
            if self._closed:
                raise GangClosedError(f"Subscriber '{self.name}' is closed.")
            if self._version is not None and self._version != self._returned:
                self._returned = self._version  # rule 4: copied, never returned yet
                return self._version
            news = self._service.news()
            with anyio.CancelScope(shield=True):  # rule 4: a copy is never left half-done
                taken = await self._take_if_new()
            await anyio.lowlevel.checkpoint()  # a cancel now leaves it for the next receive
            if taken >= 0:
                self._returned = taken
                return taken
            error = self._service.error
            if error is not None:  # a normal close stays a GangClosedError (rule 3)
                kind = GangClosedError if isinstance(error, GangClosedError) else GangError
                raise kind(str(error)) from error
            with anyio.move_on_after(max(0.0, min(deadline - time.monotonic(), 86400.0))):
                await news
            if time.monotonic() >= deadline:
                raise TimeoutError(self._timed_out(seconds))
        raise AssertionError("unreachable")

    def receive_sync(self, timeout: float | None = None) -> int:
        """[`receive`][agang.WeightSubscriber.receive] for programs without an event loop."""
        return run_sync(functools.partial(self.receive, timeout))  # type: ignore[no-any-return]

    async def _take_if_new(self) -> int:
        """``_take``, where a version newer than the last taken is ready (rule 2): on
        this loop's thread for a small model whose staging lock is free (a copy of at
        most ``INLINE_TAKE_BYTES``), else on a thread of its own (the lock waits for a
        round, a big copy takes long); -1, with no thread, where none is."""
        ready = self._service.ready  # read without the lock: _take looks again under it
        if ready is None or (self._version is not None and ready <= self._version):
            return -1
        assert self._buckets is not None
        small = self._buckets.in_place or self._buckets.staging_bytes <= INLINE_TAKE_BYTES
        if small and self._service.staging.acquire(blocking=False):
            try:
                return self._take_holding()
            finally:
                self._service.staging.release()
        taken = await run_blocking(self._take, name="weights: receive", seconds=None)
        return -1 if taken is None else taken

    def _take(self) -> int:
        """The version now in the user's tensors if newer than the last taken, else -1."""
        with self._service.staging:
            return self._take_holding()

    def _take_holding(self) -> int:
        """``_take``, the staging lock held."""
        ready = self._service.ready
        if ready is None or (self._version is not None and ready <= self._version):
            return -1
        assert self._buckets is not None
        if not self._buckets.in_place:
            self._buckets.unpack()
        self._version = ready
        self._service.taken = ready
        return ready

    def _timed_out(self, seconds: float | None) -> str:
        if self._over is not None and isinstance(self._over.source, Relayed):  # rule 5
            return (
                f"Subscriber '{self.name}' (server rank {self._over.agree.rank}) received no "
                f"version newer than {self._version} that every rank of its server holds "
                f"within {seconds:g} s; its rank 0 is the channel's member, and says more."
            )
        upstream = self._upstream
        if upstream.trouble is not None:
            how = f"the store at {self._channel.address} is not reached ({upstream.trouble})"
        else:
            silent = upstream.silent_for()
            how = (
                "the publisher's beat was never seen"
                if silent is None
                else f"the publisher last beat {silent:.1f} s ago"
            )
        return (
            f"Subscriber '{self.name}' received no version newer than {self._version} within "
            f"{seconds:g} s; it is {self._service.status}; {how}."
        )

    async def close(self) -> None:
        """Leaves the channel: the publisher's next push leaves it out at once (its
        report says so in ``dropped``: "it closed (left the channel)"). Idempotent.
        On a sharded server, every rank closes; a rank that closes alone ends the
        server's rounds (rule 5)."""
        if self._closed:
            return
        self._closed = True
        if self._over is not None and isinstance(self._over.source, Relayed):
            with anyio.CancelScope(shield=True):
                await run_blocking(self._over.stop, name="weights: close", seconds=10.0)
            return
        self._upstream.stop()
        with anyio.CancelScope(shield=True):
            await run_blocking(self._stop, name="weights: close", seconds=10.0)

    def _stop(self) -> None:
        self._service.stop(5.0)
        if self._over is not None:
            self._over.stop()
        with contextlib.suppress(Exception):  # a store gone: the push finds out anyway
            self._responder.stop()
            if self._channel.closed() is not None or not self._channel.current():
                self._channel.forget(self._me.uid)  # no publisher reads a leave any more
            else:
                self._channel.leave(self._me.uid)  # the next push leaves it out at once

    def close_sync(self) -> None:
        """[`close`][agang.WeightSubscriber.close] for programs without an event loop."""
        if not self._closed:
            self._closed = True
            if self._over is not None and isinstance(self._over.source, Relayed):
                self._over.stop()
                return
            self._upstream.stop()
            self._stop()
