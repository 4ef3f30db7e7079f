"""Failures held behind the open order checks, so that a mismatch is every rank's first
cause (engine rule 8).

Why: a rank that finds a mismatch at its check ``k`` breaks its gang, which aborts both
its groups. On the other ranks that abort fails what is still in flight there: the
checks after ``k`` on the side group (Gloo's "connection closed"), and the ops before
``k``, which agreed and started, on the main group ("connection reset by peer"). On a
busy machine those failures can arrive before the rank's own check ``k`` has read the
peer's fingerprint. Applied at once, one of them would become the gang's first cause,
and the ranks would disagree on why the gang broke: one saying mismatch, another
"connection reset".

Rules:
1. A check's *failure* (an error, not a mismatch) waits until every check issued before
   it has resolved; a started op's failure waits until every check open when it failed
   has resolved. If one of them finds the mismatch, it breaks the gang first, and the
   held failure then only finishes an op that the break already failed. Successes and
   mismatches are applied at once: ops start in sequence order, so a success cannot let
   an op overtake an earlier one.
2. A held failure is applied anyway after ``HOLD_SECONDS``, on its timer's thread
   (two given up at once may be applied in either order), so that a check that never
   ends (its peer died in the middle of the fingerprint exchange, or has not issued the
   op yet and a failure of another kind came) delays a failure by that much at most. A
   gang that breaks or closes applies what is held at once: the break or close has
   failed those ops' handles already, and their ends are recorded.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable

#: How long a failure waits for the checks before it (rule 2): the mismatch it waits for
#: arrives within milliseconds of the failure; this bounds the rare case of a check that
#: never ends.
HOLD_SECONDS = 5.0

#: A held failure's place: its position (a check's index, or the last check open when a
#: started op failed, plus a half), then a count that keeps failures at one position apart.
_Key = tuple[float, int]


class OrderChecks:
    """The open order checks of one gang, and the failures held behind them."""

    def __init__(self, name: str, hold_seconds: float = HOLD_SECONDS) -> None:
        self._name = name
        self._hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self._open: set[int] = set()  # checks started and not resolved (held ones too)
        self._held: dict[_Key, tuple[Callable[[], None], threading.Timer]] = {}
        self._count = itertools.count()

    def opened(self, index: int) -> None:
        """Check ``index`` has been started."""
        with self._lock:
            self._open.add(index)

    def resolved(self, index: int) -> None:
        """Check ``index`` ended in agreement or a mismatch, already applied."""
        with self._lock:
            self._open.discard(index)
        self._release()

    def any_open(self) -> bool:
        """Whether a check is still running in the backend (its side channel is busy)."""
        with self._lock:
            return bool(self._open)

    def failed(self, index: int, apply: Callable[[], None]) -> None:
        """Check ``index`` failed; ``apply`` fails its op, now or once the earlier checks
        have resolved (rule 1)."""
        with self._lock:
            if any(i < index for i in self._open):
                self._hold(index, apply)
                return
            self._open.discard(index)
        apply()
        self._release()

    def op_failed(self, apply: Callable[[], None]) -> bool:
        """A started op failed: holds ``apply`` (its end) until the checks open now
        have resolved, and says True; False, with nothing held, where none is open."""
        with self._lock:
            if not self._open:
                return False
            self._hold(max(self._open) + 0.5, apply)
            return True

    def drop(self) -> None:
        """The gang broke or closed: what is held is applied now (rule 2)."""
        with self._lock:
            held = [self._held[key] for key in sorted(self._held)]
            self._held.clear()
            self._open.clear()
        for apply, timer in held:
            timer.cancel()
            apply()

    def _hold(self, position: float, apply: Callable[[], None]) -> None:
        """Holds ``apply`` at ``position``, with its timer (the caller holds the lock)."""
        key = (position, next(self._count))
        timer = threading.Timer(self._hold_seconds, self._give_up, (key,))
        timer.name = f"agang: failure held behind order checks on '{self._name}'"
        timer.daemon = True
        self._held[key] = (apply, timer)
        timer.start()

    def _pop(self, key: _Key) -> tuple[Callable[[], None], threading.Timer]:
        """Takes a held failure out; a check's failure closes its check (lock held)."""
        held = self._held.pop(key)
        position = key[0]
        if position == int(position):
            self._open.discard(int(position))
        return held

    def _release(self) -> None:
        """Applies, in order, the held failures that no open check precedes."""
        while self._held:  # read unlocked: nothing held is the common case
            with self._lock:
                first = min(self._open, default=math.inf)
                ready = [key for key in self._held if key[0] <= first]
                if not ready:
                    return
                apply, timer = self._pop(min(ready))
            timer.cancel()
            apply()

    def _give_up(self, key: _Key) -> None:
        with self._lock:
            if key not in self._held:
                return
            apply, _ = self._pop(key)
        apply()
        self._release()
