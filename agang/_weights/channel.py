"""A weights channel's keys in the store (an ``agang store`` that outlives both sides).

Rules:
1. Everything lives under ``agang/weights/<channel>/<session>/``; the session is a
   token a publisher draws at ``open`` and writes under ``agang/weights/<channel>/
   session`` after its plan, so a subscriber that reads the session finds the plan, and
   a publisher started again on the channel never mixes with the last one's keys.
2. A subscriber *registers* (a ``join`` line on the ``news`` queue: id, name, where)
   and *beats* (its own key: a count and the wall-clock time) every ``BEAT`` seconds
   while it is open; the publisher admits, at a push, the registered subscribers whose
   beat is under ``STALE`` seconds old. It beats too, so a subscriber tells a publisher
   that went away from one that is only quiet. A registration also counts itself under
   ``joined``; the publisher's beat reads that count and says under ``seen`` how many it
   saw, and a subscriber's ``open`` returns once its own was seen: so a push reads the
   news (on a thread, off its loop) only when there is some, and a subscriber that
   opened before a push began is still admitted at that push. A subscriber that closes
   says so (a ``leave`` line on the same queue, counted under ``joined`` too): the next
   push leaves it out at once, instead of waiting for it to come. The publisher pops
   what it reads, so the queue holds only what it has not read yet.
3. *Epochs.* Each membership has an epoch: its members (publisher first) under
   ``e/<n>/members``; each member checks in under ``e/<n>/in`` once it read them, and
   makes the epoch's group only once the publisher says ``go`` (every member checked
   in) under ``e/<n>/go``; ``abandoned`` instead tells those that came to look for the
   next epoch, so that no one waits in a group that a missing member never joins.
4. *Drops.* A subscriber the publisher drops gets its reason under ``dropped/<id>``,
   and may register again.
5. *Status (blame).* Each subscriber's mailbox responder
   (``agang._backends.c10d.mailbox``) serves a queue under ``sub/<id>/``, with no
   traffic until asked: a ``weights_status`` letter asks where its side of the rounds
   stands, and is answered under the key it names. No answer within ``ASK_SECONDS``:
   dead, stopped, or cut off from the store. The asker deletes the answers it read,
   and remembers the keys of the last ``LATE_KEPT`` questions that were not answered
   in time: at each later question and at close it deletes those whose late answer
   has come (a server stopped across a question answers when it wakes).
6. *Nothing grows with the channel's age.* Keys that no one will read again are
   deleted by the publisher: an epoch's keys (its group's rendezvous included) once a
   later epoch's group is made, and every epoch's at close; a subscriber's beat, drop
   and mailbox once it left, or once ``DROPS_KEPT`` later drops passed since it was
   dropped (a subscriber that comes back after that many finds no drop to read; its
   wait for a new epoch ends at its deadline, saying so). What stays is a session's
   handful of fixed keys (plan, publisher, beat, counts, epoch, closed), which its
   subscribers read to learn that the publisher closed or was replaced.
7. *A store op outlives a network blip.* A side's client waits ``STORE_OP_SECONDS``
   for an op, not the 2 s of a connection attempt: a server whose link came back after
   a cut of a few seconds had its first ops delayed past 2 s by TCP's retransmits, and
   failed ("wait timeout after 2000ms"), though store and publisher were there. A key
   that may be missing is read after a check (``store_get``), never waited for, and
   Gloo's rendezvous for an epoch's group waits on this client with the group's own
   timeout, not the client's (a unit test checks it), so the bound only matters for a
   store that stopped answering.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from agang._backends.c10d import mailbox
from agang._setup.elastic import connect_store
from agang._setup.env import WorldInfo

BEAT = 0.2
STALE = 1.5
DROPS_KEPT = 64
#: The most news one look pops: a bound on the loop, far above a fleet's churn per push.
_NEWS_PER_LOOK = 100_000
ASK_SECONDS = 0.3
#: The longest a store op of the channel's waits (rule 7).
STORE_OP_SECONDS = 30.0
#: The most unanswered questions whose late answers are looked for (rule 5).
LATE_KEPT = 64
_ROOT = "agang/weights"
_KIND = "weights_status"

#: The status of each subscriber this process serves, by its responder's token (rule 5).
_status_lock = threading.Lock()
_status_of: dict[str, Callable[[], str]] = {}


def _answer(responder: mailbox.Responder, key: str) -> None:
    with _status_lock:
        status = _status_of.get(responder.token)
    if status is not None:
        responder.reply(key, " ".join(status().split()))


mailbox.register(_KIND, _answer)


def connect(host: str, port: int, deadline: float) -> Any:
    """A client of the store at ``host:port`` (an ``agang store``), retried until
    ``deadline``; raises ``GangInitError`` naming the store when it does not answer.
    Its ops then wait ``STORE_OP_SECONDS`` at most (rule 7)."""
    client = connect_store(WorldInfo(0, 1, 0, host, port, source="arguments"), deadline)
    client.set_timeout(timedelta(seconds=STORE_OP_SECONDS))
    return client


class Channel:
    """One session of a channel on ``store`` (rule 1); ``address`` is for messages."""

    def __init__(self, store: Any, channel: str, session: str, address: str) -> None:
        self.store = store
        self.name = channel
        self.session = session
        self.address = address
        self._prefix = f"{_ROOT}/{channel}/{session}"
        # Rule 5: the reply key of each question not answered in time, and whose.
        self._late: OrderedDict[str, str] = OrderedDict()

    @staticmethod
    def session_key(channel: str) -> str:
        return f"{_ROOT}/{channel}/session"

    @classmethod
    def start(cls, store: Any, channel: str, plan_text: str, where: str, address: str) -> Channel:
        """A new session, its plan and its publisher written (rule 1)."""
        opened = cls(store, channel, secrets.token_hex(6), address)
        store.set(opened._key("plan"), plan_text)
        store.set(opened._key("publisher"), where)
        opened.beat("publisher", 0)
        store.set(cls.session_key(channel), opened.session)
        return opened

    @classmethod
    def find(cls, store: Any, channel: str, address: str) -> Channel | None:
        """The channel's current session, or None before any publisher opened it."""
        key = cls.session_key(channel)
        if not store.check([key]):
            return None
        return cls(store, channel, store.get(key).decode(), address)

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _get(self, name: str) -> str | None:
        key = self._key(name)
        return store_get(self.store, key)

    def plan_text(self) -> str:
        text = self._get("plan")
        assert text is not None  # written before the session (rule 1)
        return text

    def publisher(self) -> str:
        return self._get("publisher") or "unknown"

    def current(self) -> bool:
        """Whether this is still the channel's session (no newer publisher opened it)."""
        found = store_get(self.store, self.session_key(self.name))
        return found == self.session

    # Rule 2: registration and beats.

    def register(self, uid: str, name: str, where: str) -> int:
        """Registers ``uid``; returns the registrations' count, this one's included."""
        self.store.queue_push(self._key("news"), f"join {uid} {name} {where}")
        return int(self.store.add(self._key("joined"), 1))

    def leave(self, uid: str) -> None:
        """``uid`` closed: the publisher drops it at its next push, without waiting for
        it; counted with the registrations, so that the publisher's beat sees it."""
        self.store.queue_push(self._key("news"), f"leave {uid}")
        self.store.add(self._key("joined"), 1)

    def news(self) -> list[tuple[str, str]]:
        """The registrations and leaves not read yet, in order, as (``"join"``, the
        member's text) and (``"leave"``, its id); each is read once (rule 2)."""
        found = []
        for _ in range(_NEWS_PER_LOOK):
            try:
                text = self.store.queue_pop(self._key("news"), False).decode()
            except dist.QueueEmptyError:
                break
            kind, _, rest = text.partition(" ")
            found.append((kind, rest))
        return found

    def registered(self) -> int:
        """How many registrations there were (at least as many lines as ``registrations``)."""
        return int(self.store.add(self._key("joined"), 0))

    def say_seen(self, count: int) -> None:
        """The publisher saw the first ``count`` registrations (rule 2)."""
        self.store.set(self._key("seen"), str(count))

    def seen(self) -> int:
        text = self._get("seen")
        return 0 if text is None else int(text)

    def beat(self, uid: str, count: int) -> None:
        self.store.set(self._key(f"beat/{uid}"), f"{count} {time.time():.3f}")

    def beat_age(self, uid: str) -> float | None:
        """Seconds since ``uid``'s last beat by the wall clock, or None if it never beat."""
        text = self._get(f"beat/{uid}")
        return None if text is None else max(0.0, time.time() - float(text.split()[1]))

    # Rule 3: epochs.

    def set_members(self, epoch: int, members: list[str]) -> None:
        self.store.set(self._key(f"e/{epoch}/members"), "\n".join(members))
        self.store.set(self._key("epoch"), str(epoch))

    def members(self, epoch: int) -> list[str] | None:
        text = self._get(f"e/{epoch}/members")
        return None if text is None else text.splitlines()

    def epoch(self) -> int:
        text = self._get("epoch")
        return -1 if text is None else int(text)

    def check_in(self, epoch: int, uid: str) -> None:
        self.store.append(self._key(f"e/{epoch}/in"), f"{uid}\n")

    def checked_in(self, epoch: int) -> set[str]:
        return set((self._get(f"e/{epoch}/in") or "").split())

    def say_go(self, epoch: int, go: bool) -> None:
        self.store.set(self._key(f"e/{epoch}/go"), "go" if go else "abandoned")

    def go(self, epoch: int) -> str | None:
        return self._get(f"e/{epoch}/go")

    def group_store(self, epoch: int) -> Any:
        return dist.PrefixStore(self._key(f"e/{epoch}/pg"), self.store)  # type: ignore[attr-defined]

    def forget_epoch(self, epoch: int, size: int) -> None:
        """Deletes ``epoch``'s keys (rule 6): its members, check-ins and go, and its
        group's rendezvous (Gloo's context 0 writes one key per rank, named by it)."""
        names = ["members", "in", "go", *(f"pg/0/{rank}" for rank in range(size))]
        for name in names:
            self.store.delete_key(self._key(f"e/{epoch}/{name}"))

    # Rule 4: drops; and the publisher's close.

    def drop(self, uid: str, why: str) -> None:
        self.store.set(self._key(f"dropped/{uid}"), why)

    def dropped(self, uid: str) -> str | None:
        return self._get(f"dropped/{uid}")

    def forget_drop(self, uid: str) -> None:
        """Deletes ``uid``'s drop: it registered again (rule 6)."""
        self.store.delete_key(self._key(f"dropped/{uid}"))

    def forget(self, uid: str) -> None:
        """Deletes every key of ``uid``'s (rule 6): its beat, its drop, and its mailbox's
        letters, which no one will read (a store cannot delete a queue: they are popped)."""
        self.store.delete_key(self._key(f"beat/{uid}"))
        self.forget_drop(uid)
        mailbox.drain(self.mailbox_store(uid), 0, _NEWS_PER_LOOK)

    def say_closed(self) -> None:
        self.store.set(self._key("closed"), "1")

    def closed(self) -> bool:
        return self._get("closed") is not None

    # Rule 5: status.

    def mailbox_store(self, uid: str) -> Any:
        return dist.PrefixStore(self._key(f"sub/{uid}"), self.store)  # type: ignore[attr-defined]

    def serve_status(self, uid: str, status: Callable[[], str]) -> mailbox.Responder:
        responder = mailbox.Responder(self.mailbox_store(uid), 0)
        with _status_lock:
            _status_of[responder.token] = status
        return responder

    def stop_status(self, uid: str, responder: mailbox.Responder) -> None:
        with _status_lock:
            _status_of.pop(responder.token, None)
        mailbox.post(self.mailbox_store(uid), [0], "stop", responder.token)

    def ask(self, uids: list[str], seconds: float = ASK_SECONDS) -> dict[str, str | None]:
        """Each of ``uids``' status, None for one that did not answer within ``seconds``."""
        self.sweep_late_answers()
        answers: dict[str, str | None] = dict.fromkeys(uids)
        keys = {}
        for uid in uids:
            keys[uid] = mailbox.reply_key("weights")
            mailbox.post(self.mailbox_store(uid), [0], _KIND, keys[uid])
        give_up_at = time.monotonic() + seconds
        while time.monotonic() < give_up_at and any(a is None for a in answers.values()):
            for uid in uids:
                if answers[uid] is None:
                    answers[uid] = store_get(self.mailbox_store(uid), keys[uid])
            time.sleep(mailbox.POLL_SECONDS)
        for uid in uids:  # rule 5: read, or too late to be
            self.mailbox_store(uid).delete_key(keys[uid])
            if answers[uid] is None:
                self._late[keys[uid]] = uid
        while len(self._late) > LATE_KEPT:
            self._late.popitem(last=False)
        return {uid: None if a is None else a.strip() for uid, a in answers.items()}

    def sweep_late_answers(self) -> None:
        """Deletes the late answers that have come to questions not answered in time
        (rule 5)."""
        for key, uid in list(self._late.items()):
            store = self.mailbox_store(uid)
            if store.check([key]):
                store.delete_key(key)
                del self._late[key]


def store_get(store: Any, key: str) -> str | None:
    """``key``'s value, or None where the store does not hold it (never waits for it)."""
    if not store.check([key]):
        return None
    return str(store.get(key).decode())
