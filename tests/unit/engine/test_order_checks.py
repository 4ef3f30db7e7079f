"""``OrderChecks``: a check's failure is applied behind the checks issued before it.

The Gloo race it closes is shown in ``tests/world/test_order_check.py``
(``test_c2_gloo_names_the_rank_when_a_rank_reads_the_mismatch_late``); here, its rules
alone, with no gang.
"""

from __future__ import annotations

import threading
import time

from agang._engine.order_checks import OrderChecks


def _timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("agang: order check")]


def _wait_until(condition: object, seconds: float = 10.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)


def test_a_failure_with_no_earlier_check_open_is_applied_at_once() -> None:
    checks = OrderChecks("g")
    applied: list[int] = []
    checks.opened(0)
    checks.opened(1)
    checks.failed(0, lambda: applied.append(0))
    assert applied == [0]
    checks.resolved(1)
    assert _timers() == []


def test_a_failure_waits_for_the_earlier_checks_and_follows_their_outcome() -> None:
    checks = OrderChecks("g")
    applied: list[str] = []
    for index in range(3):
        checks.opened(index)
    checks.failed(2, lambda: applied.append("failure 2"))
    checks.failed(1, lambda: applied.append("failure 1"))
    assert applied == []  # check 0 is still open: both wait, in check order
    applied.append("mismatch 0")  # the engine applies a mismatch, then says it resolved
    checks.resolved(0)
    assert applied == ["mismatch 0", "failure 1", "failure 2"]
    _wait_until(lambda: _timers() == [])  # the hold timers were cancelled


def test_a_held_failure_is_applied_after_the_hold_when_an_earlier_check_never_ends() -> None:
    checks = OrderChecks("g", hold_seconds=0.05)
    applied: list[int] = []
    checks.opened(0)
    checks.opened(1)
    checks.opened(2)
    checks.failed(1, lambda: applied.append(1))
    checks.failed(2, lambda: applied.append(2))
    _wait_until(lambda: applied == [1, 2])
    checks.resolved(0)  # late: nothing more to apply
    assert applied == [1, 2]


def test_a_broken_or_closed_gang_drops_what_is_held() -> None:
    checks = OrderChecks("g")
    applied: list[int] = []
    checks.opened(0)
    checks.opened(1)
    checks.failed(1, lambda: applied.append(1))
    assert len(_timers()) == 1
    checks.drop()
    _wait_until(lambda: _timers() == [])
    checks.resolved(0)
    assert applied == []
