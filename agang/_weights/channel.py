"""A weights channel's keys in the store (an ``agang store`` that outlives both sides).

Rules:
1. *Sessions and the holder.* Everything lives under ``agang/weights/<channel>/<session>/``;
   the session is a token a publisher draws at ``open``, and the channel's ``holder``
   key names the session that may publish. A publisher writes its plan and its
   ``where`` under its session, then takes the holder key (compare-and-set, so that two
   publishers opening at once do not both take it), so a subscriber that reads the
   holder finds the plan. A publisher that takes the channel from a live one *fences*
   it: it says so under the old session (``fenced``), and the old one, whose watch
   reads its own ``fenced`` at each beat, stops pushing and says why it is closed
   (``closed``); ``open`` returns once it did, or once it was seen silent
   (``agang._weights.publisher`` rule 5).
2. *Registration.* A subscriber *registers* (a ``join`` line on the ``news`` queue: its
   member record) and *beats* (a count under its own key, ``agang._membership.
   heartbeat``) while it is open. A registration also counts itself under ``joined``;
   the publisher's watch reads that count at each beat, reads the news when it
   changed, and then says under ``seen`` how many it read: a subscriber's ``open``
   returns once its own was seen, so a push that begins after that admits it. A
   subscriber that closes says so (a ``leave`` line, counted too). The news are popped
   as read, so the queue holds only what is unread.
3. *Epochs* are ``agang._membership.roster``'s: each membership's members (publisher
   first), the newest epoch, and the members' check-ins; the publisher says ``go`` (every
   member checked in) under the epoch, or ``abandoned``, so that no one waits in a group
   that a missing member never joins. The epoch's group makes its rendezvous under the
   epoch's ``group/`` prefix.
4. *Drops.* A subscriber the publisher drops gets its reason under ``dropped/<uid>``,
   and may register again.
5. *Status (blame).* Each subscriber answers questions (``agang._membership.questions``)
   on a mailbox under ``sub/<uid>/``, with no traffic until asked: a
   ``weights_status`` question asks where its side of the rounds stands. No answer
   within ``ASK_SECONDS``: dead, stopped, or cut off from the store. Late answers are
   deleted as they come (the questions' rule 3). While its rounds wait in an epoch's
   group, the answer says so first (``in_group``), so that the publisher can tell one
   whose round still waits in a group it ended (``still_in_group``: its receive side
   stalled) from one that saw the group end (``agang._weights.admission`` rule 3).
6. *Nothing grows with the channel's age* (``agang._weights.housekeeping``): what
   stays is a session's handful of fixed keys (plan, publisher, beat, counts, epoch,
   closed), which its subscribers read to learn that the publisher closed or was
   replaced.
7. *Authentication* (``secret``, ``agang._membership.seal``). With a channel secret,
   every control record (the holder, the plan, the fence, joins and leaves, member
   lists, go, drops, closes) is sealed (an HMAC of its key and text), and a reader
   ignores a record without a valid seal (logged once); each epoch's group makes its
   rendezvous on a sealed store, so no member connects to an address a stranger wrote.
   A stranger who reaches the store can neither publish to the servers, nor take the
   channel, nor strand a server by a forged leave or drop; the publisher takes the
   holder key back from a stranger who overwrote it. Without a secret every record is
   taken as written (``docs/guides/trust.md``).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from agang._errors import GangInitError
from agang._membership import questions
from agang._membership import store as stores
from agang._membership.heartbeat import Watch, write_beat
from agang._membership.member import Member
from agang._membership.roster import Roster
from agang._membership.seal import Seal, SealedStore, is_sealed

log = logging.getLogger("agang.weights")

#: How often each side beats (seconds), and how long the publisher must see a
#: subscriber not beat before it takes it for dead or stopped (``agang._membership.
#: heartbeat``): seven beats, so that a loaded machine's late beats are not a death.
BEAT = 0.2
STALE = 1.5
DROPS_KEPT = 64

#: How a session closed by a fence begins its ``closed`` note (``Channel.say_fenced``).
_FENCED = "another publisher opened the channel"


def closed_by_fence(note: str) -> bool:
    """Whether a session's ``closed`` note says another publisher took the channel
    (a loss to report), rather than that its publisher closed it (a normal end)."""
    return note.startswith(_FENCED)


#: The most news one look pops: a bound on the loop, far above a fleet's churn per beat.
_NEWS_PER_LOOK = 100_000
ASK_SECONDS = 0.3
_ROOT = "agang/weights"
_KIND = "weights_status"


class Channel:
    """One session of a channel on ``store`` (rule 1); ``address`` is the store's, for
    messages; ``secret`` authenticates the control records (rule 7)."""

    def __init__(
        self, store: Any, channel: str, session: str, address: str, secret: bytes | None
    ) -> None:
        self.store = store
        self.name = channel
        self.session = session
        self.address = address
        self._secret = secret
        self._seal = Seal(secret, f"weights channel '{channel}'")
        self.prefix = f"{_ROOT}/{channel}/{session}"
        self.roster = Roster(store, self.prefix)
        self._asker = questions.Asker()  # rule 5

    def rebind(self, store: Any) -> None:
        """Talks to the store through ``store`` from now on (a new connection)."""
        self.store = store
        self.roster.store = store

    @staticmethod
    def holder_key(channel: str) -> str:
        return f"{_ROOT}/{channel}/holder"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # Rule 7: sealed control records.

    def _sign(self, key: str, text: str) -> str:
        return self._seal.seal(key, text)

    def _verify(self, key: str, value: str | None) -> str | None:
        return self._seal.open(key, value)

    def group_store(self) -> Any:
        """The store an epoch's group makes its rendezvous on: sealed with a secret."""
        return self.store if self._secret is None else SealedStore(self.store, self._seal)

    def _set(self, key: str, text: str) -> None:
        self.store.set(key, self._sign(key, text))

    def _read(self, key: str) -> str | None:
        return self._verify(key, stores.read(self.store, key))

    # Rule 1: the session and its holder.

    @classmethod
    def start(
        cls,
        store: Any,
        channel: str,
        plan_text: str,
        where: str,
        address: str,
        secret: bytes | None,
    ) -> tuple[Channel, str | None]:
        """A new session with its plan, and the channel taken for it; returns it and
        the session it took the channel from (None: nobody held it)."""
        opened = cls(store, channel, secrets.token_hex(6), address, secret)
        return opened, opened.take(plan_text, where)

    def take(self, plan_text: str, where: str, *, if_free: bool = False) -> str | None:
        """Writes this session's plan and publisher, and takes the channel for it (rule
        1); returns the session it took the channel from (None: nobody held it, or this
        one did). ``if_free``: only where nobody holds it (a store that lost the session:
        opening it there again must not take it from a publisher that opened since);
        returns the holder then, where it is another."""
        self._set(self._key("plan"), plan_text)
        self._set(self._key("publisher"), where)
        self.beat("publisher", 0)
        key = self.holder_key(self.name)
        mine = self._sign(key, self.session)
        for _ in range(100):  # another publisher may take it between the read and the set
            current = stores.read(self.store, key)
            if if_free and current is not None:
                holder = self._verify(key, current)
                return None if holder == self.session else holder
            if self.store.compare_set(key, current or "", mine).decode() == mine:
                previous = self._verify(key, current)
                return None if previous == self.session else previous
        raise RuntimeError(f"the channel '{self.name}' changed hands 100 times while opening")

    @classmethod
    def find(cls, store: Any, channel: str, address: str, secret: bytes | None) -> Channel | None:
        """The channel's current session, or None before any publisher opened it (or
        while its holder key holds a record this side cannot open).

        Raises:
            GangInitError: The channel is sealed and this side has no secret (rule 7).
        """
        probe = cls(store, channel, "", address, secret)
        key = cls.holder_key(channel)
        raw = stores.read(store, key)
        if raw is not None and secret is None and is_sealed(raw):
            raise GangInitError(
                f"The weights channel '{channel}' on the store at {address} is sealed with "
                f"a secret: open it with the publisher's `secret`."
            )
        session = probe._verify(key, raw)
        return None if session is None else cls(store, channel, session, address, secret)

    @classmethod
    def secret_mismatch(cls, store: Any, channel: str, secret: bytes | None) -> str | None:
        """Why ``secret`` cannot open the channel's holder record (rule 7), or None."""
        raw = stores.read(store, cls.holder_key(channel))
        if raw is None or secret is None:
            return None
        if Seal(secret, "").open(cls.holder_key(channel), raw, quiet=True) is not None:
            return None
        if not is_sealed(raw):
            return "its publisher opened it without a secret, and this side has one"
        return "it is sealed with another secret than this side's (or a stranger wrote its holder)"

    def reclaim(self) -> None:
        """With a secret, takes the holder key back from a record without a valid MAC
        (rule 7): a stranger who overwrote it would keep new subscribers from finding
        the channel. A valid record of another publisher's is a fence, and stays."""
        if self._secret is None:
            return
        key = self.holder_key(self.name)
        current = stores.read(self.store, key)
        if current is not None and self._verify(key, current) is None:
            self.store.compare_set(key, current, self._sign(key, self.session))

    def holder(self) -> str | None:
        """The session that holds the channel now (rule 1)."""
        return self._read(self.holder_key(self.name))

    def current(self) -> bool:
        """Whether this session still holds the channel."""
        return self.holder() == self.session

    def other(self, session: str) -> Channel:
        """Another session of this channel, on the same store."""
        return Channel(self.store, self.name, session, self.address, self._secret)

    def plan_text(self) -> str | None:
        return self._read(self._key("plan"))

    def publisher(self) -> str:
        return self._read(self._key("publisher")) or "unknown"

    def fence(self, by: str) -> None:
        """Says, under this (old) session, that the publisher at ``by`` took the channel."""
        self._set(self._key("fenced"), by)

    def fence_and_wait(self, by: str, deadline: float) -> None:
        """Takes the channel from this (old) session's publisher (rule 1): tells it, then
        waits until it says it stopped, or is seen silent for ``STALE``, or ``deadline``."""
        if self.closed() is not None:
            return
        self.fence(by)
        watch = Watch(STALE)
        while time.monotonic() < deadline:
            started = time.monotonic()
            if self.closed() is not None:
                return
            beats = self.beats(["publisher"])
            ended = time.monotonic()
            watch.look(beats, started, ended)
            if watch.is_silent("publisher", ended):
                log.info(
                    "agang: channel '%s': its last publisher (%s) is silent; taken from it.",
                    self.name,
                    self.publisher(),
                )
                return
            time.sleep(BEAT / 4)

    def fenced_by(self) -> str | None:
        return self._read(self._key("fenced"))

    def say_closed(self, why: str) -> None:
        self._set(self._key("closed"), why)

    def say_fenced(self, fenced: str) -> None:
        """Closes this session because another publisher took the channel (``fenced``
        says which): subscribers must report it as a loss, not a normal end."""
        self.say_closed(f"{_FENCED} ({fenced})")

    def closed(self) -> str | None:
        """Why this session's publisher closed, or None while it is open."""
        return self._read(self._key("closed"))

    # Rule 2: registration and beats.

    def register(self, member: Member) -> int:
        """Registers ``member``; returns the registrations' count, this one's included."""
        key = self._key("news")
        self.store.queue_push(key, self._sign(key, f"join {member.to_text()}"))
        return int(self.store.add(self._key("joined"), 1))

    def leave(self, uid: str) -> None:
        """``uid`` closed: the publisher leaves it out of the next push at once."""
        key = self._key("news")
        self.store.queue_push(key, self._sign(key, f"leave {uid}"))
        self.store.add(self._key("joined"), 1)

    def news(self) -> list[tuple[str, str]]:
        """The registrations and leaves not read yet, in order, as (``"join"``, the
        member's text) and (``"leave"``, its uid); each is read once (rule 2)."""
        key = self._key("news")
        found = []
        for _ in range(_NEWS_PER_LOOK):
            try:
                value = self.store.queue_pop(key, False).decode()
            except dist.QueueEmptyError:
                break
            text = self._verify(key, value)
            if text is None:
                continue
            kind, _, rest = text.partition(" ")
            if kind in ("join", "leave"):
                found.append((kind, rest))
        return found

    def registered(self) -> int:
        """How many registrations and leaves there were."""
        return int(self.store.add(self._key("joined"), 0))

    def say_seen(self, count: int) -> None:
        """The publisher read the first ``count`` registrations and leaves (rule 2)."""
        self.store.set(self._key("seen"), str(count))

    def seen(self) -> int:
        return int(stores.read(self.store, self._key("seen")) or 0)

    def beat(self, uid: str, count: int) -> None:
        write_beat(self.store, self._key(f"beat/{uid}"), count)

    def beats(self, uids: list[str]) -> dict[str, str | None]:
        """Each of ``uids``' beat count (None: it has none)."""
        return {uid: stores.read(self.store, self._key(f"beat/{uid}")) for uid in uids}

    # Rule 3: epochs.

    def set_members(self, epoch: int, members: list[Member]) -> bool:
        """Writes ``epoch``'s members (publisher first) and makes it the newest; False
        where a list was there already (written by someone else: the epoch is spent)."""
        _, won = self.roster.decide(epoch, members, by=members[0].uid)
        if not won:
            return False
        self._set(self.roster.key(epoch, "seal"), _digest(members))  # rule 7
        self.roster.publish(epoch)
        return True

    def members(self, epoch: int) -> list[Member] | None:
        """``epoch``'s members, None before they were written, or where the list is not
        the publisher's (rule 7)."""
        members = self.roster.members(epoch)
        if members is None or self._secret is None:
            return members
        if self._read(self.roster.key(epoch, "seal")) != _digest(members):
            return None
        return members

    def epoch(self) -> int:
        newest = self.roster.newest()
        return -1 if newest is None else newest

    def check_in(self, epoch: int, uid: str) -> None:
        self.roster.check_in(epoch, uid)

    def checked_in(self, epoch: int) -> set[str]:
        return self.roster.checked_in(epoch)

    def say_go(self, epoch: int, go: bool) -> None:
        self._set(self.roster.key(epoch, "go"), "go" if go else "abandoned")

    def go(self, epoch: int) -> str | None:
        return self._read(self.roster.key(epoch, "go"))

    def group_prefix(self, epoch: int) -> str:
        """Where ``epoch``'s group makes its rendezvous (rule 3)."""
        return self.roster.key(epoch, "group")

    def forget_epoch(self, epoch: int, group_keys: list[str]) -> None:
        """Deletes ``epoch``'s keys: its members, check-ins and go, and its group's
        rendezvous keys ``group_keys`` (under ``group_prefix``)."""
        self.roster.forget(epoch, ["go", "seal", *(f"group/{key}" for key in group_keys)])

    # Rule 4: drops.

    def drop(self, uid: str, why: str) -> None:
        self._set(self._key(f"dropped/{uid}"), why)

    def dropped(self, uid: str) -> str | None:
        return self._read(self._key(f"dropped/{uid}"))

    def forget_drop(self, uid: str) -> None:
        """Deletes ``uid``'s drop: it registered again (rule 6)."""
        self.store.delete_key(self._key(f"dropped/{uid}"))

    def forget(self, uid: str) -> None:
        """Deletes every key of ``uid``'s (rule 6): its beat, its drop, and its mailbox's
        letters, which no one will read (a store cannot delete a queue: they are popped)."""
        self.store.delete_key(self._key(f"beat/{uid}"))
        self.forget_drop(uid)
        questions.forget(self.mailbox_store(uid), 0)

    # Rule 5: status.

    def mailbox_store(self, uid: str) -> Any:
        return dist.PrefixStore(self._key(f"sub/{uid}"), self.store)  # type: ignore[attr-defined]

    def serve_status(self, uid: str, status: Callable[[], str]) -> questions.Served:
        return questions.Served(self.mailbox_store(uid), 0, _KIND, status)

    def ask(self, uids: list[str], seconds: float = ASK_SECONDS) -> dict[str, str | None]:
        """Each of ``uids``' status, None for one that did not answer within ``seconds``."""
        targets = [(self.mailbox_store(uid), 0) for uid in uids]
        return dict(zip(uids, self._asker.ask(targets, _KIND, seconds), strict=True))

    def sweep_late_answers(self) -> None:
        """Deletes the late answers that have come to questions not answered in time
        (rule 5)."""
        self._asker.sweep()


def in_group(epoch: int, doing: str) -> str:
    """A subscriber's status while its rounds wait in ``epoch``'s group (rule 5)."""
    return f"in epoch {epoch}'s group, {doing}"


def still_in_group(answer: str, epoch: int) -> bool:
    """Whether a status ``answer`` says its rounds still wait in ``epoch``'s group."""
    return answer.startswith(f"in epoch {epoch}'s group, ")


def _digest(members: list[Member]) -> str:
    """A list of members in a few bytes, for its seal (rule 7)."""
    text = "\n".join(m.to_text() for m in members)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
