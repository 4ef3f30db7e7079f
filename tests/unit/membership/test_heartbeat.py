"""A member's liveness, judged on the reader's own clock (``agang._membership.heartbeat``),
driven with plain data: no thread, no store, ``now`` passed in."""

from __future__ import annotations

from agang._membership.heartbeat import Watch


def test_a_count_that_does_not_change_is_silent_after_stale_seconds() -> None:
    watch = Watch(stale=1.0)
    watch.look({"a": "1"}, 0.0, 0.0)
    assert not watch.is_silent("a", 0.9)
    watch.look({"a": "1"}, 1.0, 1.0)
    assert watch.is_silent("a", 1.0)
    assert watch.silent_for("a", 1.5) == 1.5


def test_a_count_that_changes_is_alive_whatever_time_it_writes() -> None:
    # The beat is a count: a writer whose wall clock is hours off looks the same.
    watch = Watch(stale=1.0)
    for step in range(10):
        watch.look({"a": str(step)}, step * 0.5, step * 0.5)
        assert not watch.is_silent("a", step * 0.5)


def test_a_member_first_seen_is_alive_and_one_never_seen_is_not_judged() -> None:
    watch = Watch(stale=1.0)
    assert watch.silent_for("a", 100.0) is None
    assert not watch.is_silent("a", 100.0)
    watch.look({"a": "7"}, 100.0, 100.0)  # dead long ago or not: alive when first seen
    assert not watch.is_silent("a", 100.5)
    assert watch.is_silent("a", 101.0)


def test_a_slow_look_judges_no_one() -> None:
    # The store took 5 s to answer: the members' writes may have waited as long.
    watch = Watch(stale=1.0)
    watch.look({"a": "1", "b": "1"}, 0.0, 0.0)
    watch.look({"a": "1"}, 1.0, 6.0)
    assert not watch.is_silent("a", 6.0)
    assert not watch.is_silent("b", 6.5)  # every watch starts again, not only those read
    assert watch.is_silent("b", 7.0)


def test_a_reader_that_was_stopped_does_not_take_a_live_member_for_dead() -> None:
    # The reader slept 10 s between two prompt looks: the count moved meanwhile.
    watch = Watch(stale=1.0)
    watch.look({"a": "1"}, 0.0, 0.0)
    watch.look({"a": "51"}, 10.0, 10.0)
    assert not watch.is_silent("a", 10.0)


def test_a_missing_beat_is_a_value_that_does_not_change() -> None:
    watch = Watch(stale=1.0)
    watch.look({"a": None}, 0.0, 0.0)
    assert not watch.has_beat("a")
    watch.look({"a": None}, 2.0, 2.0)
    assert watch.is_silent("a", 2.0)
    watch.forget("a")
    assert watch.silent_for("a", 2.0) is None
