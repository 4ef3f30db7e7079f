"""Death notices: what a watcher that saw a member die (a launcher, Ray, Kubernetes, a
test) says of it, and who listens.

agang learns of a death on its own only through a deadline (a member stopped or cut off
answers no one) or a closed connection (a killed one, on some transports): Ray knows of
an actor's death tens of milliseconds after it, a launcher at once. A death notice lets
that watcher tell every membership on the store, so that what waits on the member
fails at once, with the watcher's why, and the membership goes on without it.

Rules:
1. *Who listens.* A process that wants notices (an elastic gang's member, a weights
   publisher) listens on a mailbox of its own (``agang._backends.c10d.mailbox``), and
   lists that mailbox in the store's directory of listeners (``agang/deaths/listen/<id>``:
   the mailbox's prefix and rank); it takes the entry back when it stops listening.
2. *A notice* names the member as its ``where`` says ("host, pid N", the process's own
   host name and pid) or by its uid, says why (one line), and who reported it. The
   reporter appends it to the store's record of notices and leaves a ``gone`` letter
   in every listed mailbox: each listener hears of it at once, with no traffic until
   then (a mailbox's reader waits on its queue).
3. *Each feature decides what a notice means to it*: an elastic member breaks its gang
   (every op waits on every member) and its next reform leaves the dead member out
   without asking it; a weights publisher aborts a round the member is in and drops it
   with the notice's why, or drops it at the next push. A notice that names no member
   of theirs is ignored; one that names the listener itself is logged and ignored (it
   is alive to read it). Deadlines stay the backstop for what no watcher sees.
4. A listener that died leaves its entry: a later notice's letter to it is never read
   (one line in the store per such listener and notice).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import anyio
import torch.distributed as dist

from agang._backends.c10d import mailbox
from agang._errors import GangInitError
from agang._membership import store as stores
from agang._membership.member import Member
from agang._runtime.threads import run_blocking
from agang._validate import check_deadline

log = logging.getLogger("agang.membership")

#: The letter kind of a notice (rule 2).
GONE = "gone"
_DIRECTORY = "agang/deaths/listen/"
_RECORD = "agang/deaths/record"


@dataclass(frozen=True)
class Notice:
    """A member reported dead (rule 2)."""

    who: str  # "host, pid N", or a member's uid
    why: str
    by: str  # where the reporter runs

    def names(self, uid: str, where: str) -> bool:
        """Whether this notice is about the member ``uid`` that runs ``where``."""
        return self.who in (uid, where)

    def to_text(self) -> str:
        return "\t".join((self.who, self.why, self.by))

    @classmethod
    def from_text(cls, text: str) -> Notice:
        who, why, by = text.split("\t", 2)
        return cls(who, why, by)

    def describe(self) -> str:
        return f"reported dead by {self.by}: {self.why}"


def report(store: Any, notice: Notice) -> int:
    """Records ``notice`` and leaves it in every listener's mailbox (rule 2); returns how
    many listeners it was left for. Blocks on the store."""
    text = notice.to_text()
    store.append(_RECORD, text + "\n")
    count = 0
    for key in store.list_keys():
        if not key.startswith(_DIRECTORY):
            continue
        entry = stores.read(store, key) or ""  # its listener may stop meanwhile
        prefix, _, rank = entry.rpartition("\n")
        if not prefix or not rank.isdigit():
            continue
        target = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        mailbox.post(target, [int(rank)], GONE, text)
        count += 1
    return count


_lock = threading.Lock()
#: Per responder token, the listener it tells (rule 1): a process's world responder
#: (an elastic member's) or a responder of the listener's own.
_listeners: dict[str, Callable[[Notice], None]] = {}


def _heard(responder: mailbox.Responder, text: str) -> None:
    with _lock:
        listener = _listeners.get(responder.token)
    if listener is not None:
        listener(Notice.from_text(text))


mailbox.register(GONE, _heard)


@final
class Listening:
    """A process listening for notices on a mailbox (rule 1): ``prefix`` and ``rank``
    name the mailbox; ``responder`` is the one that reads it, or None to start one of
    its own. ``stop`` takes the directory's entry back (and ends its own responder)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        tell: Callable[[Notice], None],
        responder: mailbox.Responder | None = None,
    ) -> None:
        self._store = store
        self._key = f"{_DIRECTORY}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
        mailbox_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        self._own = responder is None
        self._responder = responder or mailbox.Responder(mailbox_store, rank)
        self._mailbox = mailbox_store
        self._rank = rank
        with _lock:
            _listeners[self._responder.token] = tell
        store.set(self._key, f"{prefix}\n{rank}")

    def stop(self) -> None:
        with _lock:
            _listeners.pop(self._responder.token, None)
        try:
            self._store.delete_key(self._key)
            if self._own:
                mailbox.post(self._mailbox, [self._rank], "stop", self._responder.token)
        except Exception:  # a store gone: its listeners' entries went with it
            log.debug("agang: a listener's entry could not be taken back.", exc_info=True)


async def report_death(
    store: str,
    who: str,
    why: str,
    *,
    timeout: float | None = 10.0,  # noqa: ASYNC109  # the store's, as agang.init's
) -> int:
    """Tells every elastic gang and weights publisher on the ``agang store`` at ``store``
    that the process ``who`` is dead, because ``why``: what waits on it fails at once,
    saying ``why``, and each goes on without it (an elastic gang's next reform leaves
    it out without asking it; a publisher drops it, in the same push). For watchers that
    see deaths sooner than a deadline would: a launcher, Ray, Kubernetes, a test.

    Args:
        store: The store's "HOST:PORT".
        who: The dead process as agang names it: "HOST, pid PID" (its host name, as
            ``socket.gethostname()`` says it there, and its pid), or a member's uid.
        why: One line: what the watcher saw ("exit code -9", "OOM-killed", "node lost").
        timeout: Seconds to reach the store (None: 10 s; ``math.inf``: no bound).

    Returns:
        How many listeners (members and publishers) were told.

    Raises:
        GangInitError: The store did not answer within ``timeout``.
        ValueError: An argument is invalid (the message names it).

    Example:
        <!-- not-run: needs the agang store of a running job -->
        ```python
        await agang.report_death("10.0.0.1:29500", "node7, pid 4242", "OOM-killed")
        ```
    """
    host, port = stores.parse_address(store, name="store")
    notice = Notice(_one_line(who, "who", 300), _one_line(why, "why", 1000), Member.here())
    seconds = check_deadline(timeout, name="timeout", default=10.0)
    deadline = time.monotonic() + (math.inf if seconds is None else seconds)

    def tell() -> int:
        client = stores.connect(
            host, port, min(deadline, time.monotonic() + 86400.0),
            need="A death notice needs", who="a death notice",
        )  # fmt: skip
        return report(client, notice)

    told = await run_blocking(
        tell, name="death notice", seconds=None if seconds is None else seconds + 2.0
    )
    if told is None:
        raise GangInitError(
            f"The store at {store} did not take the death notice within {seconds:g} s."
        )
    return told


def report_death_sync(store: str, who: str, why: str, *, timeout: float | None = 10.0) -> int:
    """[`report_death`][agang.report_death] for programs without an event loop."""
    return anyio.run(functools.partial(report_death, store, who, why, timeout=timeout))


def _one_line(value: object, name: str, most: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a str, but is of type `{type(value).__name__}` instead.")
    if not value.strip() or any(c in value for c in "\t\n\r") or len(value) > most:
        raise ValueError(
            f"`{name}` must be one non-empty line of at most {most} characters (no tab), but "
            f"is {value[:60]!r}{'...' if len(value) > 60 else ''} instead."
        )
    return value
