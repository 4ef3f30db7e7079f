"""Deadlines that pass: the peers are asked where they stand, then the handles fail.

The engine's rule 5, in full. One timer per gang (``deadline.Alarm``) calls
``Expiry.check``; the ops found late are failed with ``GangTimeoutError`` once the
backend's blame (``start_blame``) has said, per peer, whether it issued the op, is
waiting on it, or gave no answer.

Rules:
1. *One question per batch.* The ops found late at one check share one blame, asked
   about the oldest of them; a check that finds more while a blame is out adds them to
   it. A thousand ops timing out together cost one round of questions, not a thousand.
2. *Bounded.* The backend answers within ``BLAME_BOUND`` whatever the peers do, so a
   timeout is raised at most that much after its deadline; the answer costs nothing
   before a deadline passes (the peers read their own state only when asked).
3. *Once.* A handle already finished (its op ended while the peers were asked) is not
   failed again; ``on_timeout="abort"`` breaks the gang after the first expiry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agang._backends.contract import Progress
from agang._engine import reports
from agang._engine.scheduler import Entry
from agang._handle import Handle

if TYPE_CHECKING:
    from agang._engine.engine import Engine

log = logging.getLogger("agang")


class Expiry:
    """Rule 5 of one gang's engine (see the module's rules)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._batch: list[Entry] | None = None  # late ops waiting on the blame that is out

    def check(self, armed_for: float, driver: object) -> None:
        """The alarm's callback: finds the late ops and asks about them (rule 1)."""
        engine = self._engine
        now = time.monotonic()
        with engine.lock:
            if engine._alarm.fired(armed_for) and driver is not None:
                # The loop ran this timer late by however long it was busy or blocked.
                engine._counters.lags.append(max(0.0, now - armed_for))
            due = engine._scheduler.due(now)
            following = engine._scheduler.next_deadline()
        if following is not None:
            engine._alarm.arm(following)
        if not due:
            return
        with self._lock:
            if self._batch is not None:
                self._batch.extend(due)
                return
            self._batch = list(due)
        asked = due[0].seq
        try:
            engine.backend.start_blame(asked, lambda peers, note: self._blamed(asked, peers, note))
        except Exception as exc:  # the question never left: fail the ops without answers
            log.debug("Gang '%s' could not ask its peers.", engine.name, exc_info=True)
            self._blamed(asked, None, f"asking failed: {exc}")

    def _blamed(self, asked: int, peers: Mapping[int, Progress | None] | None, note: str) -> None:
        with self._lock:
            batch, self._batch = self._batch or [], None
        for entry in batch:
            handle, _ = entry.item
            index = entry.check_index if not entry.ready else None
            self.expire(handle, asked=asked, peers=peers, note=note, index=index)

    def expire(
        self,
        handle: Handle[Any],
        *,
        asked: int,
        peers: Mapping[int, Progress | None] | None,
        note: str,
        index: int | None,
    ) -> None:
        """Fails ``handle`` with a ``GangTimeoutError`` naming what the peers said."""
        engine = self._engine
        now = time.monotonic()
        with engine.lock:
            in_flight = engine._scheduler.describe_in_flight(now, skip=handle.seq)
            recent = [record.describe() for record in engine._scheduler.recent()]
        abort = engine.policy.on_timeout == "abort"
        where = engine.backend.where
        if peers is None:
            blamed = f"The peers could not be asked where they stand: {note}."
        else:
            blamed = reports.describe(peers, where)
            if asked != handle.seq and blamed:
                blamed = f"{blamed[:-1]} (asked about #{asked}, the oldest late op)."
        error = reports.timed_out(
            engine.context(handle.op, handle.seq, handle.timeout),
            elapsed=now - handle.issued_at,
            in_flight=in_flight,
            recent=recent,
            abort=abort,
            index=index,
            absent=None if peers is None else reports.absent(peers),
            blamed=blamed,
            peers=dict(peers) if peers is not None else None,
        )

        def count_timed_out() -> None:
            with engine.lock:
                engine._counters.num_timed_out += 1
            if abort:
                engine.break_gang(error)

        with engine.lock:
            ordered_only = handle.seq in engine._ordered_early
        if ordered_only:  # its handle succeeded once ordered; the op itself is late
            log.error("%s", error)
            count_timed_out()
            return
        # Broken before the waiters wake: their next call must be refused (rule 6).
        handle._finish(None, error, then=count_timed_out)
