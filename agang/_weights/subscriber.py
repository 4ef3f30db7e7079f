"""The server's side: ``WeightSubscriber``.

Rules:
1. ``open`` connects to the store, waits (within its timeout) for the channel's plan,
   and refuses tensors whose plan differs, naming the first differing tensor on both
   sides; then it registers, and the service (:mod:`agang._weights.service`) takes part
   in every round from the next push on, on a thread of its own.
2. ``receive`` returns the next version newer than the last it returned, once the
   user's tensors hold it: by default it copies the staging buffers into them (the
   staging costs one extra copy of the model's bytes); opened ``in_place=True``, the
   rounds write the user's tensors themselves (a request served during a push may read
   a mix of two versions: for servers that pause serving during an update), and
   ``receive`` only says which version they hold.
3. A subscriber that can take no more versions (the publisher closed or went away, the
   store went away, another subscriber of its name replaced it) makes ``receive``
   raise ``GangError`` saying which.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping

import anyio
import torch

from agang._errors import GangError, GangInitError
from agang._runtime.threads import run_blocking
from agang._weights import channel as channel_keys
from agang._weights import checks
from agang._weights.blocking import beat, blocking, run_sync
from agang._weights.buckets import Buckets
from agang._weights.channel import Channel
from agang._weights.epoch import Member
from agang._weights.plan import Plan
from agang._weights.service import Service

_PLAN_POLL = 0.05
_SEEN_POLL = 0.01
#: The most staging bytes ``receive`` copies on the caller's loop (about 0.1 ms here).
INLINE_TAKE_BYTES = 1 << 20


class WeightSubscriber:
    """Receives the versions a :class:`agang.WeightPublisher` pushes on a channel.
    Open it with :meth:`open`.

    Example:
        >>> subscriber = await agang.WeightSubscriber.open(model.state_dict(),
        ...     store="10.0.0.1:29500", channel="policy")
        >>> version = await subscriber.receive()   # model now holds it
    """

    def __init__(
        self,
        channel: Channel,
        tensors: dict[str, torch.Tensor],
        plan: Plan,
        name: str,
        timeout: float,
        in_place: bool,
    ) -> None:
        where = f"{socket.gethostname()}, pid {os.getpid()}"
        self._me = Member(f"{os.getpid()}.{secrets.token_hex(4)}", name, where)
        self._channel = channel
        self._tensors = tensors
        self._buckets = Buckets(plan, tensors, publisher=False, in_place=in_place)
        self._version: int | None = None
        self._closed = False
        self._stop_beat = _beat_for(channel, self._me.uid)
        self._registration = channel.register(self._me.uid, name, where)  # before open returns
        self._service = Service(channel, self._buckets, self._me, timeout)
        self._responder = channel.serve_status(self._me.uid, lambda: self._service.status)

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
    ) -> WeightSubscriber:
        """Joins ``channel`` on the ``agang store`` at ``store``; admitted at the next push.

        Args:
            tensors: Names to contiguous CPU tensors (a ``state_dict()``), the same names,
                order, shapes and dtypes as the publisher's.
            store: The store's "HOST:PORT".
            channel: The channel's name.
            name: This subscriber's name in reports (None: "host:pid"). A subscriber that
                opens with the name of an admitted one replaces it.
            timeout: Seconds ``open`` waits for the store and the publisher's plan, and a
                round may take on this side once it began (None: 60 s).
            in_place: Rounds write ``tensors`` themselves (no staging copy; rule 2).

        Raises:
            ValueError: ``tensors`` differ from the publisher's plan (the message names
                the first differing tensor on both sides), or an argument is invalid.
            GangInitError: The store did not answer, or no publisher opened the channel,
                before the deadline.
        """
        checked = checks.check_tensors(tensors)
        host, port = checks.check_store(store)
        channel_name = checks.check_channel(channel)
        named = checks.check_name(name) or f"{socket.gethostname()}:{os.getpid()}"
        seconds = checks.check_timeout(timeout) or 60.0
        in_place = checks.check_bool(in_place, name="in_place")
        deadline = time.monotonic() + seconds

        given_up = threading.Event()  # set when ``open`` is cancelled: its threads end

        def find() -> tuple[Channel, Plan]:
            client = channel_keys.connect(host, port, deadline)
            while True:
                found = Channel.find(client, channel_name, store)
                if found is not None:
                    return found, Plan.from_text(found.plan_text())
                if time.monotonic() >= deadline or given_up.is_set():
                    raise GangInitError(
                        f"No publisher opened the channel '{channel_name}' on the store at "
                        f"{store} within {seconds:g} s."
                    )
                time.sleep(_PLAN_POLL)

        try:
            found, theirs = await blocking(find, seconds + 2.0, what=f"the store at {store}")
        except BaseException:
            given_up.set()
            raise
        mine = Plan.of(checked, theirs.bucket_bytes)
        difference = mine.difference(theirs)
        if difference is not None:
            raise ValueError(
                f"`tensors` do not match the plan of channel '{channel_name}' (published by "
                f"{found.publisher()}): {difference}. Subscriber '{named}' was refused."
            )
        subscriber = cls(found, checked, theirs, named, seconds, in_place)
        try:
            await blocking(
                functools.partial(subscriber._wait_until_seen, deadline, given_up),
                seconds + 2.0,
                what=f"the store at {store}",
            )
        except BaseException:  # cancelled: nothing of it may stay behind
            given_up.set()
            with anyio.CancelScope(shield=True):
                await subscriber.close()
            raise
        return subscriber

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
    ) -> WeightSubscriber:
        """:meth:`open` for programs without an event loop."""
        return run_sync(  # type: ignore[no-any-return]
            functools.partial(
                cls.open,
                tensors,
                store=store,
                channel=channel,
                name=name,
                timeout=timeout,
                in_place=in_place,
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
        """The memory this subscriber holds beyond the user's tensors (rule 2)."""
        return self._buckets.staging_bytes + self._buckets.wire[0].numel()

    async def receive(self, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """Waits for a version newer than :attr:`version`, puts it in the tensors (rule 2)
        and returns it.

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
            GangError: The subscriber can take no more versions (rule 3).
        """
        seconds = checks.check_timeout(timeout)
        deadline = time.monotonic() + (math.inf if seconds is None else seconds)
        for _ in range(1_000_000):  # each pass waits for news, or ends
            if self._closed:
                raise GangError(f"Subscriber '{self.name}' is closed.")
            news = self._service.news()
            taken = await self._take_if_new()
            if taken >= 0:
                return taken
            if self._service.error is not None:
                raise GangError(str(self._service.error)) from self._service.error
            with anyio.move_on_after(max(0.0, min(deadline - time.monotonic(), 86400.0))):
                await news
            if time.monotonic() >= deadline:
                raise TimeoutError(self._timed_out(seconds))
        raise AssertionError("unreachable")

    def receive_sync(self, timeout: float | None = None) -> int:
        """:meth:`receive` for programs without an event loop."""
        return run_sync(functools.partial(self.receive, timeout))  # type: ignore[no-any-return]

    async def _take_if_new(self) -> int:
        """``_take``, where a version newer than the last taken is ready (rule 2): on
        this loop's thread for a small model whose staging lock is free (a copy of at
        most ``INLINE_TAKE_BYTES``), else on a thread of its own (the lock waits for a
        round, a big copy takes long); -1, with no thread, where none is."""
        ready = self._service.ready  # read without the lock: _take looks again under it
        if ready is None or (self._version is not None and ready <= self._version):
            return -1
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
        if not self._buckets.in_place:
            self._buckets.unpack()
        self._version = ready
        self._service.taken = ready
        return ready

    def _timed_out(self, seconds: float | None) -> str:
        try:
            age = self._channel.beat_age("publisher")
            beat = "never" if age is None else f"{age:.1f} s ago"
        except Exception:
            beat = f"unknown (the store at {self._channel.address} did not answer)"
        return (
            f"Subscriber '{self.name}' received no version newer than {self._version} within "
            f"{seconds:g} s; it is {self._service.status}; the publisher "
            f"({self._channel.publisher()}) last beat {beat}."
        )

    async def close(self) -> None:
        """Leaves the channel: the publisher's next push leaves it out at once (its
        report says so in ``dropped``: "it closed (left the channel)"). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_beat.set()
        await run_blocking(self._stop, name="weights: close", seconds=10.0)

    def _stop(self) -> None:
        self._service.stop(5.0)
        self._channel.stop_status(self._me.uid, self._responder)
        with contextlib.suppress(Exception):  # a store gone: the push finds out anyway
            if self._channel.closed() or not self._channel.current():
                self._channel.forget(self._me.uid)  # no publisher reads a leave any more
            else:
                self._channel.leave(self._me.uid)  # the next push leaves it out at once

    def close_sync(self) -> None:
        """:meth:`close` for programs without an event loop."""
        if not self._closed:
            self._closed = True
            self._stop_beat.set()
            self._stop()


def _beat_for(channel: Channel, uid: str) -> threading.Event:
    channel.beat(uid, 0)
    return beat(lambda n: channel.beat(uid, n), uid)
