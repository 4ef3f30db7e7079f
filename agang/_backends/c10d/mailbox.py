"""Blame on c10d: each process answers its peers' questions through the store.

When an op's deadline passes, the rank asks every peer where it stands on that op
(``agang._blame``). The question and the answers travel through the store of the
world's default group, which every rank already reaches, so no channel is added.

Rules:
1. *Nothing until asked.* One responder per process (a thread with a store connection
   of its own, from ``clone()``) blocks on this rank's queue in the store
   (``queue_pop``): no traffic per op, no polling. It starts when the process's first
   c10d gang serves its progress and stops when the last is released.
2. *A question* names the gang (c10d's group name: the same on every rank), the op's
   sequence number and a key to answer under; the responder appends one line there:
   its rank in that gang and its ``Progress``. A question about a gang this process
   does not serve (closed, or never made) gets no answer. Two live gangs over one group
   (a ``DeviceMesh`` wrapped twice) share its name: the one served last answers, with
   its own op numbers, and closing either leaves the other answering.
3. *Asking* pushes one question per peer, then polls the answer key until every peer
   has answered or ``ASK_SECONDS`` passed. A timer bounds the whole by ``BLAME_BOUND``
   whatever the store does (a stopped store host holds a store call for the store's
   whole timeout): past it, the report says the store did not answer, and names it.
4. *Stopping.* A process stops its own responder with a stop naming it (a token of its
   own), so a stale stop never ends another responder. The rank hosting the store,
   before it destroys the store, stops every rank's responder, so theirs end quietly
   rather than on a dropped connection (which c10d logs at length).
5. Keys live in the default group's store, under the prefix agang gives each init, so
   a store that outlives inits (torchrun's agent's) never mixes them.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from agang._backends.c10d import world
from agang._backends.contract import BLAME_BOUND, Blamed, Progress, ProgressOf
from agang._runtime.threads import start_thread

log = logging.getLogger("agang")

ASK_SECONDS = 0.3
_POLL = 0.005
_PREFIX = "agang/blame"
_STOP = "stop"
_tokens = itertools.count()


def _queue(world_rank: int) -> str:
    return f"{_PREFIX}/{world_rank}/queue"


class _Responder:
    """The thread that answers peers' questions for this process (rules 1, 2, 4)."""

    def __init__(self, store: Any, world_rank: int) -> None:
        self.token = f"{os.getpid()}.{next(_tokens)}"
        self.world_rank = world_rank
        # Per group name, every live gang over it, the last served answering (rule 2).
        self.served: dict[str, list[tuple[int, ProgressOf]]] = {}
        self._client = store.clone()  # its own connection: a blocking pop holds it
        self._client.set_timeout(timedelta(days=365))
        self.thread = start_thread(self._serve, name="blame responder")

    def _serve(self) -> None:
        try:
            while True:
                question = self._client.queue_pop(_queue(self.world_rank)).decode()
                kind, _, rest = question.partition(" ")
                if kind == _STOP:
                    if rest in ("*", self.token):
                        return
                    continue
                if kind == "ping":  # an elastic reform asks who is alive
                    self._client.append(rest, f"{self.world_rank}\n")
                    continue
                if kind == "joining":  # a process waits to join the next elastic epoch
                    with _lock:
                        _noticed.add(rest)
                    continue
                if kind == "reforming":  # a member started the next epoch: stop waiting
                    interrupt = on_reform
                    if interrupt is not None:
                        interrupt(rest)
                    continue
                self._answer(rest)
        except Exception:
            # The store went away (its host closed or died): nobody can ask any more.
            log.debug("agang: the blame responder's store connection ended.", exc_info=True)
        finally:
            self._client = None

    def _answer(self, question: str) -> None:
        group, seq, reply = question.split(" ", 2)
        with _lock:
            served = self.served.get(group)
            if not served:
                return
            rank, progress = served[-1]
        assert self._client is not None
        self._client.append(reply, f"{rank} {progress(int(seq)).to_text()}\n")


_lock = threading.Lock()
_responder: _Responder | None = None
_noticed: set[str] = set()


def serve(group_name: str, rank: int, progress: ProgressOf) -> None:
    """This process answers for its ``rank`` of group ``group_name`` (rule 1)."""
    global _responder
    store = _store()
    if store is None:
        return
    with _lock:
        if _responder is None or _responder.token.split(".")[0] != str(os.getpid()):
            try:
                _responder = _Responder(store, dist.get_rank())
            except Exception:
                log.debug("agang: peers cannot ask this rank (no store clone).", exc_info=True)
                return
        _responder.served.setdefault(group_name, []).append((rank, progress))


def unserve(
    group_name: str, progress: ProgressOf | None, *, world: bool, hosts_store: bool
) -> None:
    """Stops answering for the gang over ``group_name`` that serves ``progress``; the
    world's release stops the responder, and the store's host stops every rank's
    (rule 4)."""
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

    try:
        start_thread(stop, name="stop blame responder").wait(BLAME_BOUND)
        responder.thread.wait(BLAME_BOUND)
    except Exception:
        log.debug("agang: the blame responder did not stop in time.", exc_info=True)


def start_blame(
    group_name: str,
    seq: int,
    peers: Mapping[int, int],
    report: Blamed,
) -> None:
    """Asks ``peers`` (rank in the gang -> world rank) about op ``seq`` (rule 3)."""
    lock = threading.Lock()
    reported = False

    def once(answers: dict[int, Progress | None] | None, note: str) -> None:
        nonlocal reported
        with lock:
            if reported:
                return
            reported = True
        report(answers, note)

    store_address = world.current().store_address
    silent = (
        f"the store at {store_address} did not answer within {BLAME_BOUND} s (its host "
        f"may be stopped, or this rank cut off from it)"
    )
    timer = threading.Timer(BLAME_BOUND, once, args=(None, silent))
    timer.daemon = True
    timer.start()

    def ask() -> None:
        try:
            answers = _ask(group_name, seq, peers)
        except Exception as exc:
            log.debug("agang: asking the peers of '%s' failed.", group_name, exc_info=True)
            once(None, f"the store at {store_address} failed: {exc}")
            return
        timer.cancel()
        once(answers, "")

    _ = start_thread(ask, name=f"blame on '{group_name}'")


def _ask(group_name: str, seq: int, peers: Mapping[int, int]) -> dict[int, Progress | None]:
    store = _store()
    if store is None:
        raise RuntimeError("no default group, so no store")
    reply = f"{_PREFIX}/answers/{os.getpid()}.{next(_tokens)}"
    for world_rank in peers.values():
        store.queue_push(_queue(world_rank), f"ask {group_name} {seq} {reply}")
    answers: dict[int, Progress | None] = dict.fromkeys(peers)
    give_up_at = time.monotonic() + ASK_SECONDS
    while True:
        if store.check([reply]):
            for line in store.get(reply).decode().splitlines():
                rank, _, text = line.partition(" ")
                if int(rank) in answers:
                    answers[int(rank)] = Progress.from_text(text)
        if all(answer is not None for answer in answers.values()):
            break
        if time.monotonic() >= give_up_at:
            break
        time.sleep(_POLL)
    store.delete_key(reply)
    return answers


def _store() -> Any:
    store_override = world.current().store_override
    if store_override is not None:
        return store_override
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def noticed() -> set[str]:
    """The processes that said they wait to join the next elastic epoch."""
    with _lock:
        return set(_noticed)


def forget_noticed() -> None:
    """Forgets every notice (a reform begins: joiners still waiting notify again)."""
    with _lock:
        _noticed.clear()


def notify(store: Any, world_ranks: list[int], kind: str, text: str) -> None:
    """Tells the responders of ``world_ranks`` (on an elastic epoch's ``store``) that a
    process waits to join (``kind="joining"``, ``text`` its id), or that a member
    started the next epoch (``"reforming"``, ``text`` saying who)."""
    for world_rank in world_ranks:
        store.queue_push(_queue(world_rank), f"{kind} {text}")


def ping(store: Any, world_ranks: list[int], seconds: float) -> set[int]:
    """The ``world_ranks`` whose responder (on ``store``, an elastic epoch's) answers
    within ``seconds``: alive, and not stopped."""
    reply = f"{_PREFIX}/pings/{os.getpid()}.{next(_tokens)}"
    for world_rank in world_ranks:
        store.queue_push(_queue(world_rank), f"ping {reply}")
    alive: set[int] = set()
    give_up_at = time.monotonic() + seconds
    while time.monotonic() < give_up_at and len(alive) < len(world_ranks):
        if store.check([reply]):
            alive = {int(line) for line in store.get(reply).decode().split()}
        time.sleep(_POLL)
    return alive


#: What an elastic gang does when another member starts a reform (breaks itself).
on_reform: Callable[[str], None] | None = None
