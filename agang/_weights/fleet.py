"""The publisher's view of its subscribers, kept current by a thread of its own.

Rules:
1. Every ``BEAT`` seconds the fleet's thread raises the publisher's beat, reads whether
   another publisher took the channel (``fenced``: it then says why this session is
   closed, once, and stops), reads the registrations' count and, where it changed, the
   news (joins and leaves), then says it saw them (``agang._weights.channel`` rule 2),
   and looks at the beats of the registered subscribers and of the members
   (``agang._membership.heartbeat``: counts, judged on this process's clock).
2. *Never forgotten.* A registered subscriber, not admitted yet, that the fleet saw
   silent for ``STALE`` is dropped and told (its drop says why), so that it registers
   again when it comes back; the next push reports it. A subscriber stopped before its
   first push is either admitted when it comes back or dropped and told.
3. A registered subscriber that leaves before it was admitted is forgotten; a member
   that leaves is left out of the next push (its report says it closed).
4. *The store's trouble is the store's.* A look that fails is noted (``trouble``),
   never taken for a subscriber's death (a slow look restarts every watch); the next
   beat connects again, and where the store lost the session (it was restarted), opens
   it there again, under the same token, with the current epoch's members, so that
   the subscribers find it.
5. What a push needs of the fleet it takes at once, under a lock, with no store op
   (``take``): a push that admits nobody new costs no store op at all.
6. *Death notices* (``agang._membership.deaths``): a member a notice names is dropped,
   with the notice's why, at the next push, or at once where a round is under way
   (``on_dead`` then ends it, so that the push goes on without waiting for its
   deadline); a registered subscriber it names is forgotten, and reported.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import final

from agang._errors import one_line
from agang._membership.deaths import Notice
from agang._membership.heartbeat import Watch
from agang._membership.member import Member
from agang._runtime.threads import at_exit, start_daemon
from agang._weights.channel import BEAT, STALE, Channel
from agang._weights.housekeeping import Housekeeping

log = logging.getLogger("agang.weights")

#: How long the fleet must see a member not beat to drop it at the next push, before
#: its round (a member's round would fail at the push's deadline): twice ``STALE``, as
#: a false drop costs the member a push (it registers again).
MEMBER_SILENT = 2 * STALE


@dataclass
class Sighting:
    """What a push takes of the fleet (rule 5)."""

    #: Registered subscribers that are not members, and not seen silent, in order.
    joiners: list[Member] = field(default_factory=list)
    #: Members that closed.
    leaving: set[str] = field(default_factory=set)
    #: Members seen silent for ``MEMBER_SILENT``, and for how long.
    silent: dict[str, float] = field(default_factory=dict)
    #: The subscribers the fleet dropped since the last take, by name, with why.
    dropped: dict[str, str] = field(default_factory=dict)
    #: Members a death notice named, and its why (rule 6).
    dead: dict[str, str] = field(default_factory=dict)


@final
class Fleet:
    """The publisher's subscribers, watched on a thread of its own (module rules).

    Args:
        channel: The publisher's session.
        keeping: Its housekeeping (drops and forgets go through it).
        reconnect: Connects the channel to its store again, and opens the session there
            again where the store lost it (rule 4); blocking.
    """

    def __init__(
        self,
        channel: Channel,
        keeping: Housekeeping,
        reconnect: Callable[[], None],
        on_dead: Callable[[], None],
    ) -> None:
        self.channel = channel
        self._keeping = keeping
        self._reconnect = reconnect
        self._on_dead = on_dead
        self._dead: dict[str, str] = {}  # member uid -> a death notice's why (rule 6)
        self._lock = threading.Lock()
        self._watch = Watch(STALE)
        self._pending: dict[str, Member] = {}  # registered, not admitted
        self._members: dict[str, Member] = {}  # the current epoch's subscribers
        self._leaving: set[str] = set()
        self._dropped: dict[str, str] = {}  # name -> why, since the last take
        self._handled = 0  # the registrations and leaves read
        #: Who took the channel from this publisher (rule 1), or None.
        self.fenced_by: str | None = None
        #: What went wrong with the store at the last look, or None (rule 4).
        self.trouble: str | None = None
        self._looking = threading.Lock()  # one look at a time: the thread's, or a push's
        self._stop = threading.Event()
        self._thread = start_daemon(self._run, name="agang: weights fleet")
        at_exit(stop=self._stop.set)

    def stop(self) -> None:
        self._stop.set()

    def set_members(self, members: list[Member]) -> None:
        """The current epoch's subscribers (the publisher admitted or dropped some)."""
        with self._lock:
            self._members = {m.uid: m for m in members}
            for uid in self._members:
                self._pending.pop(uid, None)

    def take(self) -> Sighting:
        """What changed since the last push (rule 5): no store op."""
        now = time.monotonic()
        with self._lock:
            sighting = Sighting(
                joiners=[
                    m
                    for uid, m in self._pending.items()
                    if uid not in self._members and not self._watch.is_silent(uid, now)
                ],
                leaving=set(self._leaving),
                silent={
                    uid: silent
                    for uid in self._members
                    if (silent := self._watch.silent_for(uid, now) or 0.0) >= MEMBER_SILENT
                },
                dropped=self._dropped,
                dead=self._dead,
            )
            self._leaving.clear()
            self._dropped = {}
            self._dead = {}
        return sighting

    def put_back(self, joiners: list[Member]) -> None:
        """Joiners a push took but did not admit (it was cancelled): the next one will."""
        with self._lock:
            for member in joiners:
                if member.uid not in self._members:
                    self._pending.setdefault(member.uid, member)

    def silent_among(self, members: list[Member]) -> list[Member]:
        """Those of ``members`` whose beat does not change over two beats, or all where
        every one's does (blocking): whom to drop when an epoch's gang could not be made."""
        watch = Watch(BEAT)
        uids = [m.uid for m in members]
        for look in range(2):
            if look:
                time.sleep(2 * BEAT)
            started = time.monotonic()
            watch.look(self.channel.beats(uids), started, time.monotonic())
        ended = time.monotonic()
        silent = [m for m in members if watch.is_silent(m.uid, ended)]
        return silent or list(members)

    def heard(self, notice: Notice) -> None:
        """A death notice (rule 6), on the listener's thread."""
        with self._lock:
            members = [m for m in self._members.values() if notice.names(m.uid, m.where)]
            pending = [m for m in self._pending.values() if notice.names(m.uid, m.where)]
            for member in members:
                self._dead[member.uid] = notice.describe()
            for member in pending:
                del self._pending[member.uid]
                self._dropped[member.name] = notice.describe()
        if members:
            self._on_dead()

    def any_dead(self, members: list[Member]) -> bool:
        """Whether a death notice named one of ``members`` since the last sighting."""
        with self._lock:
            return any(m.uid in self._dead for m in members)

    def alive(self) -> set[str]:
        """The uids registered or admitted now."""
        with self._lock:
            return {*self._pending, *self._members}

    # The thread (rules 1 to 4).

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(BEAT):
            count += 1
            try:
                if self.trouble is not None:
                    self._reconnect()
                    with self._lock:  # what was seen before the store failed says nothing
                        self._watch = Watch(STALE)
                with self._looking:
                    if self._look(count):
                        return
                self.trouble = None
            except Exception as error:
                if self.trouble is None:
                    log.info(
                        "agang: the weights channel '%s' cannot reach its store at %s: %s",
                        self.channel.name,
                        self.channel.address,
                        one_line(error),
                    )
                self.trouble = one_line(error).rstrip(".")

    def look_now(self) -> None:
        """One look now, off the thread's beat (blocking): a push whose round failed
        learns of the leaves and deaths since the last beat before it blames anyone."""
        with self._looking:
            self._look(None)

    def _look(self, count: int | None) -> bool:
        """One beat's look (rule 1); True once fenced."""
        channel = self.channel
        if count is not None:
            channel.beat("publisher", count)
        fenced = channel.fenced_by()
        if fenced is not None:
            self.fenced_by = fenced
            channel.say_fenced(fenced)
            return True
        channel.reclaim()
        registered = channel.registered()
        if registered != self._handled:
            self._read_news(channel.news())
            self._handled = registered
            channel.say_seen(registered)
        with self._lock:
            uids = [*self._pending, *self._members]
        started = time.monotonic()
        beats = channel.beats(uids)
        ended = time.monotonic()
        self._watch.look(beats, started, ended)
        self._drop_silent(ended)
        return False

    def _read_news(self, news: list[tuple[str, str]]) -> None:
        for kind, text in news:
            if kind == "join":
                member = Member.from_text(text)
                with self._lock:
                    known = member.uid in self._members
                    if not known:
                        self._pending[member.uid] = member
                self._keeping.registered(member.uid)
            else:  # "leave" (rule 3)
                with self._lock:
                    was_pending = self._pending.pop(text, None) is not None
                    if not was_pending and text in self._members:
                        self._leaving.add(text)
                self._watch.forget(text)
                self._keeping.left(text)

    def _drop_silent(self, now: float) -> None:
        """Drops, and tells, the registered subscribers seen silent (rule 2)."""
        with self._lock:
            silent = [
                (uid, m) for uid, m in self._pending.items() if self._watch.is_silent(uid, now)
            ]
        for uid, member in silent:
            seconds = self._watch.silent_for(uid, now) or 0.0
            why = (
                f"no beat for {seconds:.1f} s before it was admitted (dead, stopped, or cut "
                f"off from the store)"
            )
            with self._lock:
                self._pending.pop(uid, None)
                self._dropped[member.name] = why
            self._watch.forget(uid)
            self._keeping.dropped(uid, why, self.alive())
