"""A member's beat, the thread that raises it, and the reader's judgement of who is
silent, on its own clock.

Rules:
1. *A beat is a count*, raised every few tenths of a second under the member's own
   key. It carries no time: a wall clock read on another host is never compared with
   this one's (hosts' clocks differ by seconds, or by far more where no one set them: a
   server 20 s behind was never admitted, and one 4 s ahead saw a live publisher as
   gone, while beats carried their writer's time).
2. *The reader judges* by when it saw each count change, on its own monotonic clock
   (``Watch``): a member whose count it saw stay the same for ``stale`` seconds is
   silent (dead, stopped, or cut off from the store). A count seen for the first time
   counts as a change: a member is alive when first seen, and one dead since before is
   found silent ``stale`` seconds later. Counts only grow, so a count that did not
   change between two looks, however far apart, was not raised in between: a reader
   that was itself stopped does not take a live member for a silent one (its count
   moved meanwhile), and a member that was stopped is silent.
3. *A slow look says nothing.* Where the store took more than ``stale / 2`` to answer
   a look, the members' writes may have waited as long: every watch starts again from
   the look's end. A stalled store never makes a live member look dead; whoever waited
   for the store reports its slowness as the store's.
4. *The beat thread* (``start_beat``) raises the count on a daemon thread of its own,
   so that no wait of the member's delays its beats, until told to stop, or until a
   write fails (the store is gone: nobody can read the beats either), or at exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, final

from agang._runtime import threads


def write_beat(store: Any, key: str, count: int) -> None:
    """Beat ``count`` under ``key`` (rule 1)."""
    store.set(key, str(count))


def start_beat(
    say: Callable[[int], None], every: float, *, name: str, at_once: bool = True
) -> threading.Event:
    """Calls ``say(1)``, ``say(2)``, ... every ``every`` seconds (the first at once, or
    after one interval) on a daemon thread, until the event returned is set or ``say``
    raises (rule 4)."""
    stop = threading.Event()

    def run() -> None:
        count = 0
        if not at_once and stop.wait(every):
            return
        while True:
            count += 1
            try:
                say(count)
            except Exception:
                return
            if stop.wait(every):
                return

    threads.start_daemon(run, name=f"agang: {name}")
    threads.at_exit(stop=stop.set)
    return stop


@dataclass
class _Seen:
    beat: str | None  # the last count seen (None: no beat under its key)
    since: float  # when (this reader's monotonic clock) it was first seen so


@final
class Watch:
    """When this reader saw each member's beat change (rules 2 and 3).

    Args:
        stale: Seconds of watched silence after which a member is silent.
    """

    def __init__(self, stale: float) -> None:
        self.stale = stale
        self._seen: dict[str, _Seen] = {}
        self._lock = threading.Lock()

    def look(self, beats: Mapping[str, str | None], started: float, ended: float) -> None:
        """Records a look at ``beats`` (uid: its count, None where it has none) that
        began at ``started`` and ended at ``ended`` (this reader's monotonic clock)."""
        with self._lock:
            if ended - started > self.stale / 2:  # rule 3: the store was slow
                for seen in self._seen.values():
                    seen.since = ended
            for uid, beat in beats.items():
                last = self._seen.get(uid)
                if last is None:
                    self._seen[uid] = _Seen(beat, ended)
                elif last.beat != beat:
                    last.beat, last.since = beat, ended

    def silent_for(self, uid: str, now: float) -> float | None:
        """Seconds since this reader saw ``uid``'s beat change, as of ``now``; None
        where it never looked at it."""
        with self._lock:
            seen = self._seen.get(uid)
        return None if seen is None else max(0.0, now - seen.since)

    def is_silent(self, uid: str, now: float) -> bool:
        """Whether ``uid`` was seen not to beat for ``stale`` seconds (rule 2)."""
        silent = self.silent_for(uid, now)
        return silent is not None and silent >= self.stale

    def has_beat(self, uid: str) -> bool:
        """Whether the last look found a beat of ``uid``'s at all."""
        with self._lock:
            seen = self._seen.get(uid)
        return seen is not None and seen.beat is not None

    def forget(self, uid: str) -> None:
        with self._lock:
            self._seen.pop(uid, None)
