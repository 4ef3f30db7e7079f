"""Learning of an op's end on the loop, where the backend must be asked: the engine's rule 11.

A backend that ``polls`` (NCCL: an op ends on a device that no host thread watches for
free) reports an op's end only when asked (``poll``), or once it has handed the op to a
thread of its own that sleeps until the end (``park``). Each hand-off between threads
wakes one that slept, which on an idle machine costs more than a small op itself, so:

1. *Poll where the news is wanted.* The engine polls at each issue; a task that awaits
   an op polls on its own loop, one loop pass between polls (the loop is never blocked:
   every other ready task runs between two polls), until the op ended.
2. *Within a budget.* Three times the median of the gang's last ``NUM_RECENT`` awaited
   ops, from ``POLL_MIN_SECONDS`` to ``POLL_MAX_SECONDS`` after the op's issue; none
   (one poll, then park) when that median is longer than the most: the gang's ops
   outlast any budget, and polling would only burn the loop's thread. An op's time is
   what its awaiting task saw: from issue to the poll that found it ended, or, where it
   parked, to then (the op took longer). An end learned later, at another op's issue or
   by the timer, tells nothing of the op's time (a stream-ordered op is learned so) and is
   not counted: it would make the budget vanish for ops that end soon.
3. *Then park.* Past its budget, an awaited op is parked, and the task sleeps until the
   backend's thread reports it. A plain thread's ``wait`` parks at once.
4. *Nobody awaits.* The gang's timer (``deadlines``) fires ``PARK_SECONDS`` after an
   issue, polls, and parks the ops running longer than that, so every op's end is
   learned, its memory freed and its room given back, whether or not it is awaited; a
   deadline polls first, so an op that ended is never late.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from agang._backends.contract import Backend
from agang._handle import Handle
from agang._runtime import loops
from agang._runtime.future import passed_loop

#: How long an awaiting task polls, at least and at most, from the op's issue (rule 2).
#: At least 200 us: parking costs two wake-ups of sleeping threads, about that much on an
#: idle machine, so a shorter budget would park ops that a pause of the loop (a garbage
#: collection, another task's step) made look slow, for no gain.
POLL_MIN_SECONDS = 200e-6
POLL_MAX_SECONDS = 500e-6
#: How many recent ops the budget is the median of (rule 2).
NUM_RECENT = 8
#: How long an op nobody awaits runs before it is parked (rule 4).
PARK_SECONDS = 2e-3


class Polling:
    """Rule 11 of one gang's engine, over its backend (see the module's rules)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._poll = backend.poll
        self._recent: collections.deque[float] = collections.deque(maxlen=NUM_RECENT)

    def learn(self, handle: Handle[Any]) -> None:
        """One poll for a task about to await ``handle`` (1): an op found ended counts
        towards the budget (2)."""
        self._poll()
        if handle.done():
            self._recent.append(time.monotonic() - handle.issued_at)

    async def settle(self, handle: Handle[Any]) -> None:
        """Polls, one loop pass between polls, until ``handle`` finished or its budget
        passed, then parks (1-3). The awaiting task has just polled (``learn``) and
        found it running, so the first poll here follows a pass."""
        backend = self._backend
        recent = self._recent
        give_up = handle.issued_at + self._budget()
        checkpoint = loops.checkpoint
        while (now := time.monotonic()) < give_up:
            await checkpoint()
            passed_loop()  # the await that follows need not pass it again
            backend.poll()
            if handle.done():
                recent.append(time.monotonic() - handle.issued_at)
                return
        recent.append(now - handle.issued_at)  # it takes longer than that (rule 2)
        backend.park()

    def park_for(self, handle: Handle[Any]) -> None:
        """A plain thread is about to block on ``handle``: learn what ended, park the rest."""
        self._backend.poll()
        if not handle.done():
            self._backend.park()

    def next_check(self, due: float | None, issued_at: float) -> float:
        """The gang's timer's next time: ``due``, or an op's park check if sooner (4)."""
        park_at = issued_at + PARK_SECONDS
        return park_at if due is None or park_at < due else due

    def reap(self, now: float) -> float | None:
        """The timer's check (4): learns what ended, parks what ran too long; when to
        look again, or None."""
        self._backend.poll()
        oldest = self._backend.park(now - PARK_SECONDS)
        return None if oldest is None else oldest + PARK_SECONDS

    def _budget(self) -> float:
        recent = self._recent
        if not recent:
            return POLL_MAX_SECONDS
        typical = sorted(recent)[len(recent) // 2]
        if typical > POLL_MAX_SECONDS:
            return 0.0
        return min(POLL_MAX_SECONDS, max(POLL_MIN_SECONDS, 3 * typical))
