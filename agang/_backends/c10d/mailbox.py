"""Each process's mailbox in the store, and blame, the first thing it answers.

Peers reach a rank through the store every rank already reaches, so no channel is
added: each world rank has a queue there, and a thread of the rank's own empties it.

Rules:
1. *Nothing until needed.* One responder per process (a thread with a store connection
   of its own, from ``clone()``) blocks on this rank's queue in the store
   (``queue_pop``): no traffic per op, no polling. It starts when the process's first
   c10d gang serves its progress and stops when the last is released.
2. *Letters.* A letter is one line, its kind, a space, then text the kind gives meaning
   to. The responder looks the kind up in a table of handlers (``register``), and
   calls the handler on its own thread with the letter's text; a kind nobody
   registered is dropped. A letter that is not text, or that its handler fails on
   (raises), is skipped, with one warning per responder and DEBUG lines after it: the
   store is open to anyone who reaches it, and a responder ended by one stray line
   would leave its rank reported "no answer" while alive, and deaf to reform notices.
   Only a stop letter, or the store's connection failing, ends it; a failing
   connection, on the process's current responder, is told to the one callback set
   with ``on_connection_lost`` (an elastic gang breaks itself: nobody can reach it
   through the store any more, and a store restarted empty holds none of its state).
   A handler replies,
   where the kind asks for it, by appending a line under a key the letter names
   (``Responder.reply``). Blame registers ``ask`` here; elastic set-up registers its
   own kinds (who is alive, who waits to join, who started the next epoch), so the
   mailbox knows none of their words.
3. *Stopping.* A process stops its own responder with a stop letter naming it (a token
   of its own), so a stale stop never ends another responder. The rank hosting the
   store, before it destroys the store, stops every rank's responder, and waits (up to
   ``BLAME_BOUND``) until each says it ended (for that stop or its own process's), so
   theirs end quietly rather than on a dropped connection (which c10d logs at length):
   a rank that finishes its init a moment after the host closed starts its responder on
   a store still there.
4. Keys live in the world's store (the default group's, or an elastic epoch's:
   ``World.store_override``), under the prefix agang gives each init, so a store that
   outlives inits (torchrun's agent's) never mixes them.
5. A forked child forgets the parent's responder (``agang._runtime.fork``), and the
   callback of rule 2: both are the parent's; the child's first gang starts its own.

Blame: when an op's deadline passes, the rank asks every peer where it stands on that op
(``Progress``, in ``agang._backends.contract``).

6. *A question* (kind ``ask``) names the gang (c10d's group name: the same on every
   rank), the op's number, a key to answer under, and last what the number counts:
   ``collective`` (the gang's collectives) or ``seq`` (every op); a question without
   it, an older rank's, counts every op. The responder appends one line under the key:
   its rank in that gang and its ``Progress``. A question about a gang
   this process does not serve (closed, or never made) gets no answer. Two live gangs
   over one group (a ``DeviceMesh`` wrapped twice) share its name: the one served last
   answers, with its own op numbers, and closing either leaves the other answering.
7. *Asking* pushes one question per peer, then polls the answer key until every peer
   has answered or ``ASK_SECONDS`` passed. A timer bounds the whole by ``BLAME_BOUND``
   whatever the store does (a stopped store host holds a store call for the store's
   whole timeout): past it, the report says the store did not answer, and names it.
8. *Giving up is told.* A rank whose deadline broke its gang aborts its communicator,
   and the peers' ops then fail with c10d's words for a lost connection ("Connection
   closed by peer"), which blame the wrong side. So before aborting it leaves each peer
   a ``gave_up`` letter naming the gang, its rank and its timeout's message (the op, the
   deadline, whom it blamed); the peer's responder keeps the last one per gang and rank
   (``notices``), for the peer's error to quote. The letter is posted before the abort
   starts, so it is in the peer's mailbox before the connection drops; a peer that
   fails off its event loop waits ``NOTICE_SECONDS`` at most for it to be read.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, final

import torch.distributed as dist

from agang._backends.c10d import world as c10d_world
from agang._backends.contract import BLAME_BOUND, Blamed, Progress, ProgressOf
from agang._runtime import fork
from agang._runtime.threads import start_thread

log = logging.getLogger("agang.c10d")

ASK_SECONDS = 0.3
#: How long a failing op waits, off the loop, for a peer's ``gave_up`` letter (rule 8).
NOTICE_SECONDS = 0.3
#: How much of a ``gave_up`` message a letter carries.
_NOTICE_CHARS = 3000
#: How often a sender looks for the replies under its key (seconds).
POLL_SECONDS = 0.005
_PREFIX = "agang/blame"
_STOP = "stop"
#: How many responders read the store host's stop letter (rule 3).
_STOPPED = f"{_PREFIX}/stopped"
_tokens = itertools.count()


def _queue(world_rank: int) -> str:
    return f"{_PREFIX}/{world_rank}/queue"


def reply_key(kind: str) -> str:
    """A key of this process's own, new at each call, for replies to letters it posts."""
    return f"{_PREFIX}/{kind}/{os.getpid()}.{next(_tokens)}"


def post(store: Any, world_ranks: list[int], kind: str, text: str) -> None:
    """Leaves a letter of ``kind`` with ``text`` in the mailbox of each of ``world_ranks``
    on ``store`` (rule 2)."""
    for world_rank in world_ranks:
        store.queue_push(_queue(world_rank), f"{kind} {text}")


def drain(store: Any, world_rank: int, most: int) -> int:
    """Pops the letters left in ``world_rank``'s mailbox on ``store`` (at most ``most``)
    that nobody will read (its reader is gone for good); how many there were. A stop
    letter is put back (rule 3): the responder it stops may not have read it yet (a
    loaded machine), and without it would wait for ever."""
    stops = []
    count = most
    for popped in range(most):
        try:
            letter = store.queue_pop(_queue(world_rank), False)
        except dist.QueueEmptyError:
            count = popped
            break
        if letter.startswith(f"{_STOP} ".encode()):
            stops.append(letter)
    for letter in stops:
        store.queue_push(_queue(world_rank), letter)
    return count - len(stops)


@final
class Responder:
    """The thread that empties this process's mailbox (rules 1 to 3)."""

    def __init__(self, store: Any, world_rank: int, *, says_ended: bool = False) -> None:
        """``says_ended``: count this responder's end under the store's ``_STOPPED``
        key (rule 3), for the world's responder where rank 0 hosts the store and waits
        for it; the memberships' own mailboxes and an elastic epoch's have no such
        host, and leave no key behind."""
        self._says_ended = says_ended
        self.token = f"{os.getpid()}.{next(_tokens)}"
        #: The rank whose mailbox this is, in the world of the store.
        self.world_rank = world_rank
        # Per group name, every live gang over it, the last served answering (rule 6).
        self.served: dict[str, list[tuple[int, ProgressOf]]] = {}
        self._client = store.clone()  # its own connection: a blocking pop holds it
        self._client.set_timeout(timedelta(days=365))
        self._warned = False  # about a skipped letter, once (rule 2)
        # Per group name, per rank of that gang, what it said when it gave up (rule 8).
        self.notices: dict[str, dict[int, str]] = {}
        self.noticed = threading.Condition()
        self.thread = start_thread(self._serve, name="blame responder")

    def reply(self, key: str, line: str) -> None:
        """Appends ``line`` (and a newline) under ``key``, on the responder's own
        connection; for handlers, on the responder's thread."""
        assert self._client is not None
        self._client.append(key, f"{line}\n")

    def _serve(self) -> None:
        try:
            while True:
                try:
                    letter = self._client.queue_pop(_queue(self.world_rank))
                except Exception as error:
                    # The store went away (its host closed or died): nobody can ask any more.
                    log.debug("agang: the blame responder's store connection ended.", exc_info=True)
                    self._lost(error)
                    return
                if self._read(letter):
                    return
        finally:
            self._client = None

    def _lost(self, error: BaseException) -> None:
        """Tells the callback of rule 2, unless this responder was replaced or stopped
        meanwhile (its gangs are closed)."""
        with _lock:
            callback = _on_lost if _responder is self else None
        if callback is None:
            return
        try:
            callback(error)
        except Exception:
            log.exception("agang: the callback for a lost store connection failed.")

    def _read(self, letter: bytes) -> bool:
        """Acts on one letter; True for a stop letter that ends this responder (rule 3).
        A letter that fails is skipped (rule 2)."""
        try:
            kind, _, text = letter.decode().partition(" ")
            if kind == _STOP:
                ends = text in ("*", self.token)
                if ends and self._says_ended:  # rule 3: the store host waits for these
                    self._client.add(_STOPPED, 1)
                return ends
            handler = _handlers.get(kind)
            if handler is not None:
                handler(self, text)
        except Exception as error:
            self._skipped(letter, error)
        return False

    def _skipped(self, letter: bytes, error: Exception) -> None:
        shown = letter[:200].decode(errors="backslashreplace")
        if self._warned:
            log.debug("agang: the blame responder skipped the letter %r: %r", shown, error)
            return
        self._warned = True
        log.warning(
            "agang: the blame responder skipped the letter %r, which it could not act "
            "on: %r. It serves on; further skipped letters are logged at DEBUG only.",
            shown,
            error,
        )


#: What the responder does with a letter's text, by the letter's kind (rule 2).
Handler = Callable[[Responder, str], None]
_handlers: dict[str, Handler] = {}


def register(kind: str, handler: Handler) -> None:
    """Makes the responder call ``handler`` with every letter of ``kind`` (rule 2): one
    handler per kind, the last registered. It runs on the responder's thread, so it must
    not wait long: no other letter is read meanwhile."""
    if not kind or " " in kind or kind == _STOP:
        raise ValueError(f"`kind` must be one word other than {_STOP!r}, but is {kind!r} instead.")
    _handlers[kind] = handler


_lock = threading.Lock()
_responder: Responder | None = None
#: What the current responder calls when its store connection fails (rule 2).
_on_lost: Callable[[BaseException], None] | None = None


def current() -> Responder | None:
    """This process's responder (its world gang's, rule 1), or None while it has none."""
    with _lock:
        return _responder


def on_connection_lost(callback: Callable[[BaseException], None] | None) -> None:
    """Makes the current responder call ``callback`` with the error, on its thread, when
    its store connection fails (rule 2): one callback, the last set; None for none. It
    must not wait long, as a handler must not."""
    global _on_lost
    if callback is not None and not callable(callback):
        raise TypeError(f"`callback` must be callable or None, but is {callback!r} instead.")
    with _lock:
        _on_lost = callback


def _forget_in_child() -> None:  # rule 5
    global _lock, _responder, _on_lost
    _lock = threading.Lock()  # a parent thread may have held it at the fork
    _responder = None
    _on_lost = None


fork.on_fork_in_child(_forget_in_child)


def _store() -> Any:
    return c10d_world.shared_store()


def serve(group_name: str, rank: int, progress: ProgressOf) -> None:
    """This process answers for its ``rank`` of group ``group_name`` (rules 1, 6)."""
    global _responder
    store = _store()
    if store is None:
        return
    with _lock:
        if _responder is None:
            try:
                # Rule 3's count is for a world whose rank 0 hosts the store; an elastic
                # epoch's store outlives its members, and nobody waits on it there.
                hosted = c10d_world.current().store_override is None
                world_rank = c10d_world.current().rank
                rank_here = dist.get_rank() if world_rank is None else world_rank
                _responder = Responder(store, rank_here, says_ended=hosted)
            except Exception:
                log.debug("agang: peers cannot ask this rank (no store clone).", exc_info=True)
                return
        _responder.served.setdefault(group_name, []).append((rank, progress))


def unserve(
    group_name: str, progress: ProgressOf | None, *, world: bool, hosts_store: bool
) -> None:
    """Stops answering for the gang over ``group_name`` that serves ``progress``; the
    world's release stops the responder, and the store's host stops every rank's
    (rule 3)."""
    global _responder
    with _lock:
        responder = _responder
        if responder is None:
            return
        served = responder.served.get(group_name, [])
        served[:] = [entry for entry in served if entry[1] is not progress]
        if not served:
            responder.served.pop(group_name, None)
        if not world and responder.served:
            return
        _responder = None
    size = dist.get_world_size() if hosts_store else 0

    def stop() -> None:
        store = _store()
        if store is None:
            return
        store.queue_push(_queue(responder.world_rank), f"{_STOP} {responder.token}")
        for rank in range(size):
            if rank != responder.world_rank:
                store.queue_push(_queue(rank), f"{_STOP} *")
        # Rule 3: every rank's responder (this one's too) says it ended, or the store
        # would go from under a rank still finishing its init (its responder's read then
        # fails, and c10d logs the dropped connection at length). A responder its own
        # process stopped says so too, so closing together costs no wait.
        give_up_at = time.monotonic() + BLAME_BOUND
        while size > 1 and store.add(_STOPPED, 0) < size and time.monotonic() < give_up_at:
            time.sleep(POLL_SECONDS)
        del store  # the host's store must not outlive its close in this thread

    try:
        # Longer than the thread's own bound: a thread still holding the store after the
        # close would keep its port taken, and an init at once after on the same port
        # would fail with "in use".
        start_thread(stop, name="stop blame responder").wait(2 * BLAME_BOUND)
        responder.thread.wait(BLAME_BOUND)
    except Exception:
        log.debug("agang: the blame responder did not stop in time.", exc_info=True)


def _answer(responder: Responder, question: str) -> None:
    """Rule 6: ``question`` is ``<group> <number> <key> [collective|seq]``; raises
    ``ValueError`` for any other text (the responder skips it: rule 2)."""
    parts = question.split(" ")
    by = parts[3] if len(parts) == 4 else "seq"  # an older rank's question: by seq
    if len(parts) not in (3, 4) or not all(parts) or by not in ("collective", "seq"):
        raise ValueError(
            f"a question is '<group> <number> <key> [collective|seq]', but this is {question!r}"
        )
    group, key = parts[0], parts[2]
    number = int(parts[1])
    collective = by == "collective"
    with _lock:
        served = responder.served.get(group)
        if not served:
            return
        rank, progress = served[-1]
    responder.reply(key, f"{rank} {progress(number, collective).to_text()}")


register("ask", _answer)


def tell_gave_up(group_name: str, rank: int, peers: Mapping[int, int], message: str) -> None:
    """Leaves each of ``peers`` (gang rank: world rank) a ``gave_up`` letter: this
    process, ``rank`` of group ``group_name``, gave up with ``message`` (rule 8). Blocks
    for the store's pushes: call it off the loop, before the abort."""
    store = _store()
    if store is None or not peers:
        return
    text = " ".join(message.split())[:_NOTICE_CHARS]
    post(store, list(peers.values()), "gave_up", f"{group_name} {rank} {text}")


def _note(responder: Responder, text: str) -> None:
    """Rule 8: ``text`` is ``<group> <rank> <message>``; raises ``ValueError`` otherwise."""
    group, rank, message = text.split(" ", 2)
    with responder.noticed:
        responder.notices.setdefault(group, {})[int(rank)] = message
        responder.noticed.notify_all()


register("gave_up", _note)


def notices(group_name: str, wait: float = 0.0) -> dict[int, str]:
    """What the ranks of group ``group_name`` that gave up said (rule 8), waiting up to
    ``wait`` seconds for a first one."""
    responder = _responder
    if responder is None:
        return {}
    with responder.noticed:
        if wait > 0:
            responder.noticed.wait_for(lambda: group_name in responder.notices, wait)
        return dict(responder.notices.get(group_name, {}))


def start_blame(
    group_name: str,
    number: int,
    peers: Mapping[int, int],
    report: Blamed,
    *,
    collective: bool = False,
) -> None:
    """Asks ``peers`` (rank in the gang -> world rank) about op ``number``, a number
    among the gang's collectives where ``collective`` (rule 7)."""
    lock = threading.Lock()
    reported = False

    def once(answers: dict[int, Progress | None] | None, note: str) -> None:
        nonlocal reported
        with lock:
            if reported:
                return
            reported = True
        report(answers, note)

    store_address = c10d_world.current().store_address
    silent = (
        f"the store at {store_address} did not answer within {BLAME_BOUND} s (its host "
        f"may be stopped, or this rank cut off from it)"
    )
    timer = threading.Timer(BLAME_BOUND, once, args=(None, silent))
    timer.daemon = True
    timer.start()

    def ask() -> None:
        try:
            answers = _ask(group_name, number, peers, collective)
        except Exception as exc:
            log.debug("agang: asking the peers of '%s' failed.", group_name, exc_info=True)
            once(None, f"the store at {store_address} failed: {exc}")
            return
        timer.cancel()
        once(answers, "")

    _ = start_thread(ask, name=f"blame on '{group_name}'")


def _ask(
    group_name: str, number: int, peers: Mapping[int, int], collective: bool
) -> dict[int, Progress | None]:
    store = _store()
    if store is None:
        raise RuntimeError("no default group, so no store")
    key = reply_key("answers")
    by = "collective" if collective else "seq"
    post(store, list(peers.values()), "ask", f"{group_name} {number} {key} {by}")
    answers: dict[int, Progress | None] = dict.fromkeys(peers)
    give_up_at = time.monotonic() + ASK_SECONDS
    while True:
        if store.check([key]):
            for line in store.get(key).decode().splitlines():
                rank, _, text = line.partition(" ")
                if int(rank) in answers:
                    answers[int(rank)] = Progress.from_text(text)
        if all(answer is not None for answer in answers.values()):
            break
        if time.monotonic() >= give_up_at:
            break
        time.sleep(POLL_SECONDS)
    store.delete_key(key)
    return answers
