"""agang's own threads, and what happens to them when the interpreter exits.

Rules:
1. A thread that runs Python code while the interpreter finalizes is ended by CPython
   with a forced unwind when it next takes the GIL. Through torch's C++ frames (freeing
   a tensor's last reference releases the GIL and takes it back; so does returning from
   a c10d ``wait``) that unwind aborts the process: "terminate called without an active
   exception". So every agang thread must be idle, or gone, before finalization starts.
2. Every thread agang starts is a daemon (one stuck in c10d must never keep the process
   alive) made by ``start_daemon``. Threads that run completions, aborts, closes and
   deadlines are tracked (weakly) and joined at exit: ``join`` returns only once the
   thread has ended, after it dropped its target and the target's references (a thread
   marked done when its target returns could still be freeing them). Set-up threads
   (init, store probes, making groups) and store questions are joined too: one that
   returns from c10d's C++ during finalization aborts the process as above (an init
   that failed at its deadline, its store probes still retrying, did, at every exit).
3. At exit (an ``atexit`` handler: CPython runs those before finalizing), in order: the
   closers run (open world gangs close: their running work is aborted and their waiter
   threads told to end); then the stoppers (threads that otherwise live for ever, the
   deadline timer and the gangs' CUDA watchers, end their loops); then every tracked thread is
   joined. All of it within ``EXIT_SECONDS``: a thread still busy then (c10d blocked on
   a hung peer) is left, with a warning, and exit goes on.
4. The closers and stoppers act on registries of their modules, which a forked child
   empties (``agang._runtime.fork``): the child's exit never touches what it inherited. The
   threads tracked here are the parent's: the child forgets them, and makes its lock anew.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("agang")

EXIT_SECONDS = 5.0

_lock = threading.Lock()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_closers: list[Callable[[], None]] = []
_stoppers: list[Callable[[], None]] = []


def start_daemon(
    target: Callable[[], None], *, name: str, join_at_exit: bool = True
) -> threading.Thread:
    """Starts ``target`` on a daemon thread, joined at exit unless told not to (rule 2)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    if join_at_exit:
        with _lock:
            _threads.add(thread)
    thread.start()
    return thread


def add_closer(close: Callable[[], None]) -> None:
    """Runs ``close`` first at exit (rule 3); it may block, within the exit bound."""
    with _lock:
        _closers.append(close)


def add_stopper(stop: Callable[[], None]) -> None:
    """Runs ``stop`` at exit, after the closers; it must ask a thread to end, not wait."""
    with _lock:
        _stoppers.append(stop)


def _forget_in_child() -> None:
    global _lock, _threads
    _lock = threading.Lock()  # a parent thread may have held it at the fork
    _threads = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _quiesce() -> None:
    give_up_at = time.monotonic() + EXIT_SECONDS
    with _lock:
        steps = [*_closers, *_stoppers]

    def run_steps() -> None:
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("agang: a step at exit failed.")

    # On a thread of its own: a closer stuck in c10d must not hold exit past the bound.
    start_daemon(run_steps, name="agang: exit")
    while True:
        with _lock:
            busy = [t for t in _threads if t.is_alive()]
        left = give_up_at - time.monotonic()
        if not busy or left <= 0:
            break
        busy[0].join(left)
    if busy:
        names = ", ".join(sorted(t.name for t in busy))
        log.warning("agang: threads still busy %g s into exit: %s", EXIT_SECONDS, names)
