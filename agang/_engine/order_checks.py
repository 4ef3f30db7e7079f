"""Order checks' failures, applied behind the checks issued before them (engine rule 8).

Why: a rank that finds a mismatch at its check ``k`` breaks its gang, which aborts the
side group the checks run on. The checks after ``k``, already posted there by the
other ranks, then fail on those ranks with a transport error (Gloo's "connection
closed"), and on a busy machine that failure can arrive before the rank's own check
``k`` has read the peer's fingerprint. Applied at once, it would become the gang's first
cause, and the ranks would disagree on why the gang broke: one saying mismatch, another
"connection closed".

Rules:
1. A check's *failure* (an error, not a mismatch) waits until every check issued
   before it has resolved. If one of them finds the mismatch, it breaks the gang first,
   and the held failure then only finishes an op that the break already failed.
   Successes and mismatches are applied at once, as before: ops start in sequence
   order, so a success cannot let an op overtake an earlier one.
2. A held failure is applied anyway after :data:`HOLD_SECONDS`, so that an earlier check
   that never ends (its peer died in the middle of the fingerprint exchange) cannot hide
   it. A gang that breaks or closes drops what is held: its ops were failed with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

#: How long a check's failure waits for the checks before it (rule 2): the mismatch it
#: waits for arrives within milliseconds of the failure; this bounds the rare case of
#: an earlier check that never ends.
HOLD_SECONDS = 5.0


class OrderChecks:
    """The open order checks of one gang, and the failures held behind them."""

    def __init__(self, name: str, hold_seconds: float = HOLD_SECONDS) -> None:
        self._name = name
        self._hold_seconds = hold_seconds
        self._lock = threading.Lock()
        self._open: set[int] = set()  # checks started and not resolved (held ones too)
        self._held: dict[int, tuple[Callable[[], None], threading.Timer]] = {}

    def opened(self, index: int) -> None:
        """Check ``index`` has been started."""
        with self._lock:
            self._open.add(index)

    def resolved(self, index: int) -> None:
        """Check ``index`` ended in agreement or a mismatch, already applied."""
        with self._lock:
            self._open.discard(index)
        self._release()

    def failed(self, index: int, apply: Callable[[], None]) -> None:
        """Check ``index`` failed; ``apply`` fails its op, now or once the earlier checks
        have resolved (rule 1)."""
        with self._lock:
            if any(i < index for i in self._open):
                timer = threading.Timer(self._hold_seconds, self._give_up, (index,))
                timer.name = f"agang: order check failure held on '{self._name}'"
                timer.daemon = True
                self._held[index] = (apply, timer)
                timer.start()
                return
            self._open.discard(index)
        apply()
        self._release()

    def drop(self) -> None:
        """The gang broke or closed: what is held is moot (rule 2)."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
            self._open.clear()
        for _, timer in held:
            timer.cancel()

    def _release(self) -> None:
        """Applies, in check order, the held failures that no open check precedes."""
        while True:
            with self._lock:
                first = min(self._open, default=None)
                if first is None or first not in self._held:
                    return
                apply, timer = self._held.pop(first)
                self._open.discard(first)
            timer.cancel()
            apply()

    def _give_up(self, index: int) -> None:
        with self._lock:
            held = self._held.pop(index, None)
            if held is None:
                return
            self._open.discard(index)
        held[0]()
        self._release()
