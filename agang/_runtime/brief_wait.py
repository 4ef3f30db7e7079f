"""Waiting briefly (``wait_mode="block_briefly"``): blocking a loop's thread for a small op.

Waking a task when its future finishes on another thread (``future.wait_async``) costs a
thread hop and a loop iteration, most of a small op's time on a busy machine. A gang that
asks for it lets an await of a small op block the loop's thread, sleeping on a lock that
the op's completion releases, for a short window when nothing else on the loop could run
meanwhile; past the window it parks as ``wait_async`` does. Rules:

1. Only ops of at most ``BRIEF_MAX_BYTES``, only when this size of op recently took
   at most ``BRIEF_MAX_SECONDS`` (the median of its last ``NUM_RECENT`` times,
   per power of two of bytes: a median, since a small op's times have a long tail), and
   until at most three times that after the op's issue, never past ``BRIEF_MAX_SECONDS``
   of blocking. One slow op (a peer late) thus stops nothing; a run of them stops the
   blocking until ops are fast again.
2. Never while another waiter is parked on this loop (a block would delay it), nor
   while the loop has other ready work: asyncio's ready queue (``_ready``, CPython's
   loop), trio's runnable tasks. A loop that cannot tell (uvloop) is never blocked;
   there the mode is ``"park"`` (measured, it gained nothing there either).
3. Blocks that end without the op finishing, in a row (a loop-driven backend, as
   FakeWorld, finishes nothing while its loop is blocked; or ops became slow), make the
   next 1, 3, 7, ... up to 1,023 awaits of that size park at once; a block that catches
   its op resets this. One miss alone does not: small ops' times have a long tail.
4. It sleeps; it never spins. Spinning was measured slower here: the completion runs
   Python on the backend's thread, which needs the GIL and, on a small machine, a core.
5. It changes nothing but timing: the await then takes the path of a future already
   finished (one checkpoint), with the same result, error and cancellation.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from agang._runtime import loops
from agang._runtime.future import Future, add_done_callback, num_parked, remove_done_callback

#: Ops above this size never block: the wake-up is a small share of their time.
BRIEF_MAX_BYTES = 1 << 20
#: The longest one await blocks its loop's thread, and the slowest op it blocks for.
BRIEF_MAX_SECONDS = 1e-3
#: How many recent times of one size of op the estimate is the median of.
NUM_RECENT = 8

# The median of recent op times (seconds from issue to finish), and those times, by
# ``num_bytes.bit_length()``. Loop threads share them; a lost update under a race only
# shifts a window.
_estimates: dict[int, float] = {}
_recent: dict[int, list[float]] = {}
# Per size as above: blocks in a row that ended unfinished, and awaits left to skip.
_num_missed: dict[int, int] = {}
_num_to_skip: dict[int, int] = {}


def block_briefly(future: Future[Any], num_bytes: int, issued_at: float) -> bool:
    """Blocks this (loop) thread until ``future`` finishes, within the rules above.

    Args:
        future: A pending op's handle.
        num_bytes: The op's size.
        issued_at: When it was issued (``time.monotonic()``).

    Returns:
        Whether ``future`` finished while this call blocked.
    """
    if num_bytes > BRIEF_MAX_BYTES or num_parked():
        return False
    key = num_bytes.bit_length()
    estimate = _estimates.get(key)
    if estimate is None or estimate > BRIEF_MAX_SECONDS:
        return False
    if _num_to_skip.get(key, 0) > 0:  # > 0: two loop threads racing here may go below
        _num_to_skip[key] -= 1
        return False
    window = min(BRIEF_MAX_SECONDS, issued_at + 3 * estimate - time.monotonic())
    if window <= 0 or not _loop_is_idle():
        return False
    # A bare lock released by the finisher, as ``Future._block`` does.
    signal = threading.Lock()
    signal.acquire()
    add_done_callback(future, signal.release)
    if signal.acquire(timeout=window):
        _num_missed[key] = 0
        return True
    remove_done_callback(future, signal.release)
    missed = _num_missed[key] = min(_num_missed.get(key, 0) + 1, 10)
    _num_to_skip[key] = 2 ** (missed - 1) - 1
    return False


def record(num_bytes: int, seconds: float) -> None:
    """Feeds the estimate with an op's time from issue to finish (rule 1)."""
    key = num_bytes.bit_length()
    recent = _recent.setdefault(key, [])
    recent.append(seconds)
    if len(recent) > NUM_RECENT:
        del recent[0]
    _estimates[key] = sorted(recent)[len(recent) // 2]


def _loop_is_idle() -> bool:
    """True when the running loop has no other ready work (rule 2); False where it
    cannot tell (uvloop)."""
    loop = loops.asyncio_loop()
    if loop is not None:
        ready = getattr(loop, "_ready", None)
        return ready is not None and not ready
    import trio

    return trio.lowlevel.current_statistics().tasks_runnable == 0
