"""A subscriber's view of its channel, kept current by a thread of its own: its beat,
and what the publisher and the store say.

Rules:
1. Every ``BEAT`` seconds the thread raises the subscriber's beat and reads, in one
   look: whether the publisher closed, was fenced, or another holds the channel; the
   newest epoch; a drop of this subscriber's; and the publisher's beat, judged on this
   process's own clock (``agang._membership.heartbeat``): a publisher seen silent for
   ``PUBLISHER_GONE`` seconds is gone (dead or stopped). Never a wall clock of another
   host: a server whose clock is ahead saw a live publisher as gone.
2. The rounds never wait for the store: the service reads what the last look found
   (``newest``, ``gone``), so that a store that stalls does not stall a round, which
   needs nothing of it.
3. *The store's trouble is the store's.* A look that fails is noted (``trouble``) and
   judges no one (a slow look restarts the watch): the publisher is never blamed for
   the store's silence. The next beat connects again; a store that lost the session
   (restarted empty) is waited for until the publisher opens it there again (its
   fleet does, at its next beat), and then this subscriber registers there again
   unless it is a member of the epoch under way (``on_back`` then restarts its status
   responder on the new connection). A store gone for longer than the subscriber's
   timeout ends it, naming the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, final

from agang._errors import one_line
from agang._membership.heartbeat import Watch
from agang._membership.member import Member
from agang._runtime.threads import at_exit, start_daemon
from agang._weights.channel import BEAT, Channel, closed_by_fence

log = logging.getLogger("agang.weights")

#: How long a subscriber must see the publisher not beat to take it for gone (rule 1).
PUBLISHER_GONE = 3.0


@final
class Upstream:
    """The channel as subscriber ``me`` sees it (module rules).

    Args:
        channel: The session it subscribed to.
        me: The subscriber.
        timeout: How long the store may be gone before the subscriber gives up.
        connect: A new client of the store, by a deadline (rule 3).
        on_back: Called (on this thread) once a lost store is reached again.
    """

    def __init__(
        self,
        channel: Channel,
        me: Member,
        timeout: float | None,
        connect: Callable[[float], Any],
        on_back: Callable[[], None],
    ) -> None:
        self.channel = channel
        self.me = me
        self._timeout = timeout
        self._connect = connect
        self._on_back = on_back
        self._watch = Watch(PUBLISHER_GONE)
        #: The newest epoch the publisher wrote (-1 before any), at the last look.
        self.newest = -1
        #: Why the publisher can send no more (closed, fenced, gone), or None.
        self.gone: str | None = None
        #: ``gone`` is the publisher's close of the channel: a normal end, not a loss.
        self.closed_normally = False
        #: This subscriber's drop, where it has one: why.
        self.dropped: str | None = None
        #: What went wrong with the store, and since when (monotonic), or None.
        self.trouble: str | None = None
        self._trouble_since = 0.0
        #: When (monotonic) the last look ended well.
        self.looked_at = time.monotonic()
        #: Whether the service is in an epoch's rounds (it need not register again).
        self.member = False
        self._stop = threading.Event()
        self._count = 0
        self._beat()  # before ``open`` returns: the publisher finds a beat at once
        self._thread = start_daemon(self._run, name=f"agang: weights upstream {me.name}")
        at_exit(stop=self._stop.set)

    def stop(self) -> None:
        self._stop.set()

    def newest_now(self) -> int:
        """The newest epoch, read from the store where the last look is older than two
        beats (this process was stopped, or its thread starved), else the last look's:
        for a round that would overwrite a version not taken yet."""
        if time.monotonic() - self.looked_at <= 2 * BEAT:
            return self.newest
        try:
            return max(self.newest, self.channel.epoch())
        except Exception:
            return self.newest

    def silent_for(self) -> float | None:
        """Seconds since the publisher's beat was last seen to change (None: never
        seen), for messages."""
        return self._watch.silent_for("publisher", time.monotonic())

    def _beat(self) -> None:
        self._count += 1
        self.channel.beat(self.me.uid, self._count)

    def _run(self) -> None:
        while not self._stop.wait(BEAT):
            try:
                if self.trouble is not None and not self._reconnect():
                    continue
                self._look()
                self.trouble = None
            except Exception as error:
                self._troubled(one_line(error).rstrip("."))

    def _troubled(self, what: str) -> None:
        if self.trouble is None:
            self._trouble_since = time.monotonic()
            log.info(
                "agang: subscriber '%s' cannot reach the store at %s: %s",
                self.me.name,
                self.channel.address,
                what,
            )
        self.trouble = what
        lasted = time.monotonic() - self._trouble_since
        if self._timeout is not None and lasted > self._timeout and self.gone is None:
            self.gone = (
                f"the store at {self.channel.address} went away: not reached for "
                f"{lasted:.1f} s ({what})"
            )

    def _look(self) -> None:
        """One beat's look (rules 1, 2)."""
        channel = self.channel
        started = time.monotonic()
        self._beat()
        closed = channel.closed()
        holder = channel.holder()
        beat = channel.beats(["publisher"])
        newest = channel.epoch()
        dropped = channel.dropped(self.me.uid)
        ended = time.monotonic()
        self._watch.look(beat, started, ended)
        self.looked_at = ended
        self.newest = max(self.newest, newest)
        self.dropped = dropped
        if self.gone is not None:
            return
        if closed is not None:
            publisher = channel.publisher()
            self.closed_normally = not closed_by_fence(closed)
            self.gone = (
                f"the publisher ({publisher}) closed the channel"
                if self.closed_normally
                else closed
            )
        elif holder is not None and holder != channel.session:
            self.gone = "another publisher opened the channel since (the last one was restarted)"
        elif self._watch.is_silent("publisher", ended):
            silent = self._watch.silent_for("publisher", ended) or 0.0
            self.gone = (
                f"the publisher ({channel.publisher()}) went away: this subscriber saw it "
                f"not beat on the store at {channel.address} for {silent:.1f} s (dead or "
                f"stopped)"
            )

    def _reconnect(self) -> bool:
        """Rule 3: a new connection; True once the session is there (the publisher
        opened it again on a store that lost it), registered again where needed."""
        channel = self.channel
        channel.rebind(self._connect(time.monotonic() + 2.0))
        if channel.plan_text() is None:  # restarted empty: the publisher opens it again
            self._troubled("the store lost the channel's session; waiting for its publisher")
            return False
        self._watch = Watch(PUBLISHER_GONE)  # what was seen before says nothing now
        self._on_back()
        if not self.member:
            channel.register(self.me)
        log.info("agang: subscriber '%s' reached the store again.", self.me.name)
        return True
