"""Counting hand-offs: an op's news passed from one thread to another.

A hand-off wakes a sleeping thread: a thread woken to wait for an op (an op parked on a
gang's waiter), or an event loop woken from another thread to learn of one (a waiter
parked in ``future.wait_async``). On an idle machine each costs far more than agang's own
work per op, so agang avoids them where it can (an awaited NCCL op is learned on the
loop's own thread), and counts those it makes: the benches and tests read the count per
awaited op.
"""

from __future__ import annotations

import threading

from agang._runtime import fork

_lock = threading.Lock()
_count = 0


def count_handoff() -> None:
    """Counts one hand-off."""
    global _count
    with _lock:
        _count += 1


def num_handoffs() -> int:
    """How many hand-offs this process has made since it started."""
    return _count


def _forget_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a parent thread may have held it at the fork


fork.on_fork_in_child(_forget_in_child)
