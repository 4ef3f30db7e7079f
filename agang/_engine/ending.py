"""How ops and a gang end: the engine's rules 4 and 10 (completion), 6 (failure) and 7
(closing), as functions of the engine (``engine``), which binds them as its methods.

An op's end comes back through its ``OpEnd`` (``ops``) to :func:`complete`; one that ended
inside its start on the issuing thread is taken by the engine itself (``Engine._start_now``)
and never comes here.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from agang._backends.contract import Done
from agang._errors import CollectiveError, GangBrokenError, GangClosedError, GangTimeoutError
from agang._handle import Handle

if TYPE_CHECKING:
    from agang._engine.engine import Engine

log = logging.getLogger("agang")


# Completion (rules 4 and 10).


def complete(engine: Engine, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
    """The backend op behind ``handle`` has ended (its tensors are free)."""
    now = time.monotonic()
    seconds = now - handle.issued_at
    # A handle that already failed (its deadline passed) records as timed out.
    timed_out = isinstance(handle._error, GangTimeoutError)
    outcome = "timed out" if timed_out else ("ok" if error is None else "failed")
    with engine.lock:
        entry = engine._scheduler.finish(handle.seq, seconds=seconds, outcome=outcome)
        room_waiters = engine._room.wake()
        ordered_early = engine._ordered_early
        if ordered_early and handle.seq in ordered_early:
            ordered_early.discard(handle.seq)
            if error is None:
                engine._counters.completed(handle.op, seconds)
            counted = False  # its handle finished when ordered: nothing more to count
        else:
            # The common end: a success whose entry just left the core, so no deadline
            # or break can fail its handle any more: it is counted now, before it
            # finishes (a waiter that finds it done sees it counted), not in a ``then``.
            counted = (
                error is None
                and entry is not None
                and not entry.expired
                and engine.broken is None
                and not engine.closed
                and not handle._settled()
            )
            if counted:
                engine._counters.completed(handle.op, seconds)
    for waiter in room_waiters:
        waiter._finish(None, None)
    if counted:
        handle._finish(value, None)
    elif error is None:

        def count_completed() -> None:
            with engine.lock:
                engine._counters.completed(handle.op, time.monotonic() - handle.issued_at)

        handle._finish(value, None, then=count_completed)
    else:
        if isinstance(error, GangBrokenError | GangClosedError | CollectiveError):
            wrapped: BaseException = error
        else:
            context = engine.context(handle.op, handle.seq, handle.timeout)
            explained = f"{context.describe()} failed: {error}{engine.backend.explain(error)}"
            wrapped = CollectiveError(explained, context)
            wrapped.__cause__ = error

        def count_failed_and_break() -> None:
            with engine.lock:
                engine._counters.num_failed += 1
            engine.break_gang(wrapped)

        # Broken before the waiters wake: their next call must be refused (rule 6).
        finished = handle._finish(None, wrapped, then=count_failed_and_break)
        if not finished and not isinstance(error, GangBrokenError | GangClosedError):
            # Timed out (on_timeout="raise"), then failed in c10d: unusable all the same.
            engine.break_gang(wrapped)
    if engine._scheduler.num_queued:
        engine._drain()


def ordered(engine: Engine, handle: Handle[Any], value: Any) -> None:
    """The op behind ``handle`` is ordered on the caller's stream (rule 10)."""
    with engine.lock:
        engine._ordered_early.add(handle.seq)
    handle._finish(value, None)


# Failure and closing (rules 6 and 7).


def _take_pending(engine: Engine) -> tuple[list[Any], list[tuple[Handle[Any], Done]]]:
    """The pending handles, room waiters and never-started ops (now dropped); the caller
    holds the lock, has marked the gang broken or closed, and fails them unlocked."""
    items = [entry.item for entry in engine._scheduler.entries.values()]
    dropped = [entry.item for entry in engine._scheduler.drop_queued()]
    pending: list[Any] = [handle for handle, _ in items if not handle._settled()]
    engine._counters.num_failed += len(pending)
    engine._ops_left_in_backend = any(e.started for e in engine._scheduler.entries.values())
    pending.extend(engine._room.wake())  # they fail with the others, and re-check
    return pending, dropped


def break_gang(engine: Engine, cause: BaseException) -> None:
    """Marks the gang broken by ``cause``, fails what is pending, aborts the backend."""

    def abandoned(what: object) -> BaseException:
        error = GangBrokenError(
            f"{what} on gang '{engine.name}' was abandoned: the gang broke on an earlier "
            f"failure: {cause}",
            cause,
        )
        error.__cause__ = cause
        return error

    with engine.lock:
        if engine.broken is not None or engine.closed:
            return
        engine.broken = cause
        pending, dropped = _take_pending(engine)
    log.error("Gang '%s' (rank %d) is broken: %s", engine.name, engine.rank, cause)
    for future in pending:
        future._finish(None, abandoned(future))
    for handle, abandon in dropped:
        abandon(abandoned(handle))  # releases their tensors; nothing was started
    try:
        # A woken waiter may have closed it meanwhile: backends cope with abort after release.
        engine.backend.abort()
    except Exception:
        log.exception("Aborting the communicator of gang '%s' failed.", engine.name)


def mark_closed(engine: Engine) -> bool:
    """Closes the gang at once, failing pending waiters (rule 7); False if closed."""
    with engine.lock:
        if engine.closed:
            return False
        engine.closed = True
        pending, dropped = _take_pending(engine)
    for future in pending:
        future._finish(
            None, GangClosedError(f"{future} was pending when gang '{engine.name}' was closed.")
        )
    for handle, abandon in dropped:
        abandon(GangClosedError(f"{handle} was pending when gang '{engine.name}' was closed."))
    return True
