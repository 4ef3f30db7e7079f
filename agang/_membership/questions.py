"""Asking members where they stand, through their mailboxes in the store; and answering.

A member that stops answering is dead, stopped, or cut off from the store: both
membership features ask before they leave a member out (an elastic reform pings the
members that have not arrived; a weights publisher asks the subscribers that did not
confirm a round).

Rules:
1. *Answering.* A member answers on a responder (``agang._backends.c10d.mailbox``): a
   thread that waits on its queue in the store, so that no traffic flows until someone
   asks. ``serve`` starts one that answers questions of a kind with a line that says
   where the member stands; an elastic member answers on its process's responder,
   whose handlers elastic set-up registers.
2. *Asking* (``Asker.ask``) leaves one question per target, each with a reply key of
   its own, and polls the keys until every target answered or ``seconds`` passed.
3. The asker deletes the answers it read, and remembers the keys of the last
   ``LATE_KEPT`` questions not answered in time; each later question, and ``sweep``,
   deletes those whose late answer has come (a member stopped across a question
   answers when it wakes), so that nothing grows with the membership's age.
4. Every call may block on the store: call them off the event loop.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, final

from agang._backends.c10d import mailbox
from agang._membership import store as stores

#: The most unanswered questions whose late answers are looked for (rule 3).
LATE_KEPT = 64
#: The longest ``Served.stop`` waits for its responder to end.
STOP_SECONDS = 2.0
#: The most letters ``forget`` pops from a mailbox no one will read.
_MOST_LETTERS = 100_000

#: Target: a mailbox, as the store it lives in and the rank whose queue it is.
Target = tuple[Any, int]


@final
class Asker:
    """Asks targets questions and tidies the answers (rules 2, 3)."""

    def __init__(self) -> None:
        self._late: OrderedDict[str, Any] = OrderedDict()  # reply key -> its store

    def ask(self, targets: Sequence[Target], kind: str, seconds: float) -> list[str | None]:
        """Each target's answer to a question of ``kind``, None for one that did not
        answer within ``seconds`` (rule 2)."""
        self.sweep()
        keys = []
        for store, rank in targets:
            key = mailbox.reply_key(kind)
            keys.append(key)
            mailbox.post(store, [rank], kind, key)
        answers: list[str | None] = [None] * len(targets)
        give_up_at = time.monotonic() + seconds
        while time.monotonic() < give_up_at and any(a is None for a in answers):
            for index, (store, _) in enumerate(targets):
                if answers[index] is None:
                    answers[index] = stores.read(store, keys[index])
            time.sleep(mailbox.POLL_SECONDS)
        for index, (store, _) in enumerate(targets):  # rule 3: read, or too late to be
            store.delete_key(keys[index])
            if answers[index] is None:
                self._late[keys[index]] = store
        while len(self._late) > LATE_KEPT:
            self._late.popitem(last=False)
        return [None if a is None else a.strip() for a in answers]

    def sweep(self) -> None:
        """Deletes the late answers that have come to questions not answered in time."""
        for key, store in list(self._late.items()):
            if store.check([key]):
                store.delete_key(key)
                del self._late[key]

    def late(self) -> list[str]:
        """The reply keys of the questions still waiting for a late answer."""
        return list(self._late)


_answers_lock = threading.Lock()
#: What each responder ``serve`` started answers, by kind, then by responder token.
_answers: dict[str, dict[str, Callable[[], str]]] = {}


def _answer(kind: str) -> Callable[[mailbox.Responder, str], None]:
    def answer(responder: mailbox.Responder, key: str) -> None:
        with _answers_lock:
            say = _answers.get(kind, {}).get(responder.token)
        if say is not None:
            responder.reply(key, " ".join(say().split()))

    return answer


@final
class Served:
    """A responder that answers one kind of question (rule 1); ``stop`` ends it."""

    def __init__(self, store: Any, rank: int, kind: str, say: Callable[[], str]) -> None:
        with _answers_lock:
            if kind not in _answers:
                _answers[kind] = {}
                mailbox.register(kind, _answer(kind))
        self._store = store
        self._rank = rank
        self._kind = kind
        self._responder = mailbox.Responder(store, rank)
        with _answers_lock:
            _answers[kind][self._responder.token] = say

    def stop(self, seconds: float = STOP_SECONDS) -> None:
        """Stops answering, and ends the responder, waiting ``seconds`` at most for it
        (its stop letter goes through the store: a store gone leaves it to end with its
        connection). The wait matters: a ``forget`` of the mailbox right after would pop
        the stop letter before the responder read it, and leave it waiting for ever."""
        with _answers_lock:
            _answers.get(self._kind, {}).pop(self._responder.token, None)
        try:
            mailbox.post(self._store, [self._rank], "stop", self._responder.token)
        except Exception:  # the store is gone: the responder ends with its connection
            return
        with contextlib.suppress(TimeoutError):
            self._responder.thread.wait(seconds)


def forget(store: Any, rank: int) -> int:
    """Pops the letters left in ``rank``'s mailbox on ``store`` that no one will read
    (its reader is gone for good); how many there were. Stop letters stay (the
    mailbox's rule 3)."""
    return mailbox.drain(store, rank, _MOST_LETTERS)
