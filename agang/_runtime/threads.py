"""The threads agang starts: running a blocking call off the loop, and exiting cleanly.

One module, since both halves are one rule: every thread agang starts is made here
(``start_daemon``), so that exit can find it and wait for it.

Running a blocking call (c10d set-up, destroy, store waits) off the event loop: each call
gets its own daemon thread (``start_thread``, ``run_blocking``). These calls are rare
(init, create_gang, close), and a daemon thread stuck in c10d can never keep the process
from exiting, which a pooled non-daemon worker could. The caller awaits a future the
thread finishes, so the wait is cancellable on every backend; a cancelled or timed-out
call leaves its thread to end on its own (c10d gets a bounded timeout of its own from the
caller). ``run_all`` runs many teardowns at once.

Rules of exit:
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
   deadline timer and the gangs' completion waiters, end their loops); then every tracked
   thread is joined. All of it within ``EXIT_SECONDS``: a thread still busy then (c10d
   blocked on a hung peer) is left, with a warning, and exit goes on. Modules register
   both kinds with ``at_exit``.
4. The closers and stoppers act on registries of their modules, which a forked child
   empties (``agang._runtime.fork``): the child's exit never touches what it inherited.
   The threads tracked here are the parent's: the child forgets them, and makes its lock
   anew.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from agang._runtime import fork
from agang._runtime.future import Future, finish

log = logging.getLogger("agang.runtime")

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


def at_exit(
    *, close: Callable[[], None] | None = None, stop: Callable[[], None] | None = None
) -> None:
    """Registers what runs at exit (rule 3): ``close`` first, with the other closers (it
    may block, within the exit bound); ``stop`` after every closer (it asks a thread to
    end, and must not wait for it)."""
    with _lock:
        if close is not None:
            _closers.append(close)
        if stop is not None:
            _stoppers.append(stop)


def _forget_in_child() -> None:
    global _lock, _threads
    _lock = threading.Lock()  # a parent thread may have held it at the fork
    _threads = weakref.WeakSet()


fork.on_fork_in_child(_forget_in_child)


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


T = TypeVar("T")


def start_thread(fn: Callable[[], T], *, name: str, join_at_exit: bool = True) -> Future[T]:
    """Runs ``fn`` on a new daemon thread; the future finishes with its result.

    ``join_at_exit=False`` only for a thread that never runs c10d code: one still inside
    c10d when the interpreter ends aborts the process ("terminate called without an
    active exception"), so those are joined at exit, within its bound (rule 2).
    """
    future: Future[Any] = Future(name)

    def run() -> None:
        try:
            value = fn()
        except BaseException as exc:
            finish(future, None, exc)
        else:
            finish(future, value, None)

    start_daemon(run, name=f"agang: {name}", join_at_exit=join_at_exit)
    return future


async def run_blocking(
    fn: Callable[[], T], *, name: str, seconds: float | None, join_at_exit: bool = True
) -> T | None:
    """Awaits ``fn()`` run on a daemon thread, giving up after ``seconds``.

    Returns:
        ``fn``'s result, or None if ``seconds`` passed first (the thread is left to end).
    """
    future = start_thread(fn, name=name, join_at_exit=join_at_exit)
    with anyio.move_on_after(seconds):
        return await future
    return None


def run_all(fns: list[Callable[[], None]], *, name: str, max_threads: int = 32) -> None:
    """Runs ``fns`` at once on up to ``max_threads`` daemon threads; returns when all have.

    For teardowns that mostly wait (a Gloo group's destructor waits about 18 ms for its
    threads here): 400 lanes released one by one would take seconds. An error is logged,
    not raised, so one failed release never leaves the others undone.
    """
    if len(fns) <= 1:
        for fn in fns:
            _logged(fn, name)
        return
    pending = list(fns)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not pending:
                    return
                fn = pending.pop()
            _logged(fn, name)

    threads = []
    for _ in range(min(max_threads, len(fns))):
        try:
            threads.append(start_daemon(work, name=f"agang: {name}", join_at_exit=False))
        except RuntimeError:  # no new threads (interpreter shutting down): go on here
            break
    work()
    for thread in threads:
        thread.join()


def _logged(fn: Callable[[], None], name: str) -> None:
    try:
        fn()
    except Exception:
        log.exception("%s failed.", name)
