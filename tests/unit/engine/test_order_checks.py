"""``OrderChecks``: failures are applied behind the open order checks.

The Gloo races it closes are shown in ``tests/world/test_order_check.py``
(``test_c2_gloo_names_the_rank_when_a_rank_reads_the_mismatch_late``: a later check's
failure and a started op's, both caused by the peer's abort); here, its rules alone,
with no gang.
"""

from __future__ import annotations

import threading
import time

from agang._engine.order_checks import OrderChecks

NAME = "order-checks-unit-test"  # the timers of other tests' gangs are not counted


def _timers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(f"'{NAME}'")]


def _wait_until(condition: object, seconds: float = 10.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)


def test_a_failure_with_no_earlier_check_open_is_applied_at_once() -> None:
    checks = OrderChecks(NAME)
    applied: list[int] = []
    checks.opened(0)
    checks.opened(1)
    checks.failed(0, lambda: applied.append(0))
    assert applied == [0]
    checks.resolved(1)
    assert _timers() == []


def test_a_failure_waits_for_the_earlier_checks_and_follows_their_outcome() -> None:
    checks = OrderChecks(NAME)
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
    checks = OrderChecks(NAME, hold_seconds=0.05)
    applied: list[int] = []
    checks.opened(0)
    checks.opened(1)
    checks.opened(2)
    checks.failed(1, lambda: applied.append(1))
    checks.failed(2, lambda: applied.append(2))
    # Each on its own timer's thread: in either order (a CI run saw 2 first).
    _wait_until(lambda: sorted(applied) == [1, 2])
    checks.resolved(0)  # late: nothing more to apply
    assert sorted(applied) == [1, 2]


def test_a_started_ops_failure_waits_for_the_checks_open_when_it_failed() -> None:
    checks = OrderChecks(NAME)
    applied: list[str] = []
    assert not checks.op_failed(lambda: applied.append("never"))  # none open: not held
    checks.opened(0)
    checks.opened(1)
    assert checks.op_failed(lambda: applied.append("op"))
    checks.opened(2)  # opened after the failure: not waited for
    checks.resolved(1)
    assert applied == []
    applied.append("mismatch 0")
    checks.resolved(0)
    assert applied == ["mismatch 0", "op"]
    checks.resolved(2)
    _wait_until(lambda: _timers() == [])


def test_a_broken_or_closed_gang_applies_what_is_held_at_once() -> None:
    checks = OrderChecks(NAME)
    applied: list[str] = []
    checks.opened(0)
    checks.opened(1)
    checks.failed(1, lambda: applied.append("check 1"))
    assert checks.op_failed(lambda: applied.append("op"))
    assert len(_timers()) == 2
    checks.drop()
    assert applied == ["check 1", "op"]
    _wait_until(lambda: _timers() == [])
    checks.resolved(0)
    assert applied == ["check 1", "op"]
