"""The scheduler's pure core, driven with plain data (the rules of ``agang._engine.scheduler``)."""

from __future__ import annotations

import pytest

from agang._engine.scheduler import Entry, Scheduler


def entry(seq: int, num_bytes: int = 10, deadline: float | None = None, **flags: bool) -> Entry:
    return Entry(
        seq=seq,
        op="all_reduce",
        num_bytes=num_bytes,
        issued_at=0.0,
        deadline=deadline,
        start=lambda: None,
        **flags,
    )


def take_all(scheduler: Scheduler) -> list[int]:
    started = []
    while (next_entry := scheduler.take_next()) is not None:
        started.append(next_entry.seq)
    return started


def test_ops_start_in_admission_order_up_to_the_op_bound() -> None:
    scheduler = Scheduler(max_ops=3, max_bytes=10**9)
    for seq in range(5):
        scheduler.admit(entry(seq))

    assert take_all(scheduler) == [0, 1, 2]
    assert scheduler.num_queued == 2
    scheduler.finish(1, seconds=0.1, outcome="ok")  # out of order: frees one slot
    assert take_all(scheduler) == [3]
    scheduler.finish(0, seconds=0.1, outcome="ok")
    assert take_all(scheduler) == [4]
    assert scheduler.num_in_flight == 3
    assert scheduler.num_queued == 0


def test_the_byte_bound_holds_ops_but_a_lone_huge_op_still_runs() -> None:
    scheduler = Scheduler(max_ops=100, max_bytes=100)
    scheduler.admit(entry(0, num_bytes=60))
    scheduler.admit(entry(1, num_bytes=60))
    scheduler.admit(entry(2, num_bytes=1000))

    assert take_all(scheduler) == [0]  # 60 + 60 > 100
    scheduler.finish(0, seconds=0.0, outcome="ok")
    assert take_all(scheduler) == [1]
    scheduler.finish(1, seconds=0.0, outcome="ok")
    assert take_all(scheduler) == [2]  # larger than the bound, but alone
    assert scheduler.bytes_started == 1000


def test_a_later_small_op_never_overtakes_a_held_one() -> None:
    scheduler = Scheduler(max_ops=100, max_bytes=100)
    scheduler.admit(entry(0, num_bytes=90))
    scheduler.admit(entry(1, num_bytes=90))
    scheduler.admit(entry(2, num_bytes=1))

    assert take_all(scheduler) == [0]  # seq 2 would fit, but order comes first


def test_an_op_waits_for_its_order_check() -> None:
    scheduler = Scheduler(max_ops=10, max_bytes=10**9)
    scheduler.admit(entry(0, ready=False))
    scheduler.admit(entry(1))

    assert take_all(scheduler) == []
    scheduler.set_ready(0)
    assert take_all(scheduler) == [0, 1]


def test_the_gate_holds_later_ops_between_two_phases() -> None:
    scheduler = Scheduler(max_ops=10, max_bytes=10**9)
    scheduler.admit(entry(0, holds_gate=True))
    scheduler.admit(entry(1))

    assert take_all(scheduler) == [0]
    assert scheduler.num_queued == 1  # held by the gate, with room to start
    assert not scheduler.may_start(0)
    scheduler.release_gate(0)
    assert take_all(scheduler) == [1]
    assert scheduler.num_queued == 0
    assert scheduler.may_start(0)


def test_finishing_a_gate_holder_opens_the_gate() -> None:
    scheduler = Scheduler(max_ops=10, max_bytes=10**9)
    scheduler.admit(entry(0, holds_gate=True))
    scheduler.admit(entry(1))
    take_all(scheduler)

    scheduler.finish(0, seconds=0.0, outcome="failed")
    assert take_all(scheduler) == [1]


def test_is_full_counts_queued_ops_too() -> None:
    scheduler = Scheduler(max_ops=2, max_bytes=100)
    assert not scheduler.is_full(10**6)  # an empty gang always admits one op
    scheduler.admit(entry(0, num_bytes=50))
    assert not scheduler.is_full(50)
    assert scheduler.is_full(51)
    scheduler.admit(entry(1, num_bytes=10))
    assert scheduler.is_full(0)  # two ops, the bound


def test_deadlines_come_due_in_time_order_once_each() -> None:
    scheduler = Scheduler(max_ops=10, max_bytes=10**9)
    scheduler.admit(entry(0, deadline=5.0))
    scheduler.admit(entry(1, deadline=2.0))
    scheduler.admit(entry(2, deadline=None))
    scheduler.admit(entry(3, deadline=3.0))

    assert scheduler.next_deadline() == 2.0
    assert [e.seq for e in scheduler.due(3.0)] == [1, 3]
    assert scheduler.due(3.0) == []  # each at most once
    assert scheduler.next_deadline() == 5.0
    scheduler.finish(0, seconds=1.0, outcome="ok")
    assert scheduler.next_deadline() is None  # finished ops leave the heap lazily
    assert scheduler.due(100.0) == []


def test_an_expired_op_stays_in_flight_until_it_finishes() -> None:
    scheduler = Scheduler(max_ops=1, max_bytes=10**9)
    scheduler.admit(entry(0, deadline=1.0))
    scheduler.admit(entry(1))
    take_all(scheduler)

    assert [e.seq for e in scheduler.due(2.0)] == [0]
    assert scheduler.num_in_flight == 2
    assert take_all(scheduler) == []  # the expired op still holds its room
    scheduler.finish(0, seconds=2.5, outcome="timed out")
    assert take_all(scheduler) == [1]


def test_dropping_the_queue_leaves_started_ops_in_flight() -> None:
    scheduler = Scheduler(max_ops=1, max_bytes=10**9)
    for seq in range(3):
        scheduler.admit(entry(seq))
    take_all(scheduler)

    dropped = scheduler.drop_queued()
    assert [e.seq for e in dropped] == [1, 2]
    for dropped_entry in dropped:  # the driver finishes them, as abandoned
        scheduler.finish(dropped_entry.seq, seconds=0.0, outcome="abandoned")
    assert list(scheduler.entries) == [0]
    assert scheduler.finish(1, seconds=0.0, outcome="abandoned") is None  # already gone


def test_the_flight_recorder_keeps_the_last_finished_ops() -> None:
    scheduler = Scheduler(max_ops=100, max_bytes=10**9, history=3)
    for seq in range(5):
        scheduler.admit(entry(seq))
    take_all(scheduler)
    for seq in range(5):
        scheduler.finish(seq, seconds=0.001 * seq, outcome="ok")

    assert [r.seq for r in scheduler.recent()] == [2, 3, 4]
    assert scheduler.recent()[-1].describe() == "all_reduce seq=4 10 B 4.0 ms ok"


def test_in_flight_lines_show_each_ops_state() -> None:
    scheduler = Scheduler(max_ops=1, max_bytes=10**9)
    scheduler.admit(entry(0))
    scheduler.admit(entry(1))
    scheduler.admit(entry(2, ready=False))
    take_all(scheduler)

    lines = scheduler.describe_in_flight(now=1.5, skip=1)
    assert lines == [
        "all_reduce seq=0 10 B started, issued 1.500 s ago",
        "all_reduce seq=2 10 B checking, issued 1.500 s ago",
    ]


def test_a_sequence_number_is_admitted_once() -> None:
    scheduler = Scheduler(max_ops=1, max_bytes=1)
    scheduler.admit(entry(0))
    with pytest.raises(ValueError, match="seq 0"):
        scheduler.admit(entry(0))


def test_bytes_in_flight_balance_after_every_kind_of_finish() -> None:
    scheduler = Scheduler(max_ops=2, max_bytes=10**9)
    for seq in range(4):
        scheduler.admit(entry(seq, num_bytes=seq + 1))
    take_all(scheduler)
    scheduler.finish(3, seconds=0.0, outcome="abandoned")  # queued
    scheduler.finish(0, seconds=0.0, outcome="ok")  # started
    assert scheduler.bytes_in_flight == 2 + 3
    take_all(scheduler)
    scheduler.finish(1, seconds=0.0, outcome="ok")
    scheduler.finish(2, seconds=0.0, outcome="ok")
    assert (scheduler.bytes_in_flight, scheduler.bytes_started, scheduler.num_started) == (0, 0, 0)


def test_an_op_may_start_at_once_only_with_nothing_ahead_and_room() -> None:
    scheduler = Scheduler(max_ops=2, max_bytes=100)
    assert scheduler.may_start(10**6)  # nothing started: even a huge op runs, alone
    scheduler.admit_started(entry(0, num_bytes=60))
    assert (scheduler.num_started, scheduler.bytes_started, scheduler.num_in_flight) == (1, 60, 1)
    assert scheduler.may_start(40)
    assert not scheduler.may_start(41)  # bytes
    scheduler.admit_started(entry(1, num_bytes=1))
    assert not scheduler.may_start(0)  # ops
    scheduler.finish(0, seconds=0.0, outcome="ok")
    assert scheduler.may_start(0)
    scheduler.admit(entry(2, ready=False))
    assert not scheduler.may_start(0)  # one queued ahead


def test_an_op_that_never_entered_is_still_recorded() -> None:
    scheduler = Scheduler(max_ops=2, max_bytes=100)
    scheduler.record(7, "all_reduce", 4, 0.002, "ok")
    assert [r.describe() for r in scheduler.recent()] == ["all_reduce seq=7 4 B 2.0 ms ok"]
    assert scheduler.num_in_flight == 0


def test_deadlines_out_of_issue_order_come_due_in_time_order() -> None:
    scheduler = Scheduler(max_ops=10, max_bytes=10**9)
    for seq, deadline in enumerate([2.0, 4.0, 1.0, 4.0, 3.0, 6.0]):
        scheduler.admit(entry(seq, deadline=deadline))
    assert scheduler.next_deadline() == 1.0
    assert [e.seq for e in scheduler.due(4.0)] == [2, 0, 4, 1, 3]
    assert scheduler.next_deadline() == 6.0


def test_deadlines_of_ops_finished_out_of_order_cost_memory_per_op_in_flight() -> None:
    scheduler = Scheduler(max_ops=10**6, max_bytes=10**12)
    scheduler.admit(entry(0, deadline=1.0))  # a straggler: all later ops finish first
    for seq in range(1, 10_000):
        scheduler.admit(entry(seq, deadline=1.0 + seq))
        scheduler.finish(seq, seconds=0.0, outcome="ok")
    assert len(scheduler._timeline) + len(scheduler._deadlines) <= 2 + 64 + 1
    assert [e.seq for e in scheduler.due(10.0**6)] == [0]
