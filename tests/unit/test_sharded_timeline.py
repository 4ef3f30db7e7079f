"""``bench/sharded_timeline.py`` lines up the marks of the sharded bench's processes:
the stretches of the timed turns, per size and kind, and each mark's median after its
stretch's start. Its wrappers are not installed here (they patch agang's classes for a
whole process); the bench runs them (``bench_weights.py --sharded --timeline DIR``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sharded_timeline as timeline


def _write(folder: Path, name: str, events: list[tuple[float, str, str]]) -> None:
    """``events`` as (milliseconds, who, what), in a process's file."""
    text = "".join(f"{int(ms * 1e6)}\t{who}\t{what}\n" for ms, who, what in events)
    (folder / name).write_text(text)


def _turn(at: float, push_ms: float, heard_ms: float) -> tuple[list, list]:
    """A hand-made round at ``at`` then a push 10 ms later: rank 0's and rank 1's marks."""
    push = at + 10
    zero = [
        (at, "rank 0", timeline.HAND_START),
        (at + 5, "rank 0", "hand-made: shares came"),
        (push, "rank 0", timeline.PUSH_START),
        (push + 0.1, "rank 0", "said ROUND"),
        (push + push_ms, "rank 0", "push returned"),
    ]
    one = [
        (push + heard_ms, "rank 1", "heard ROUND"),
        (push + heard_ms + 1, "rank 1", "heard ROUND"),
    ]
    return zero, one


def test_the_timed_turns_are_lined_up_across_processes(tmp_path: Path) -> None:
    zero: list = [(0.0, "rank 0", timeline.PUSH_START), (1.0, "rank 0", "push returned")]  # untimed
    zero.append((2.0, "rank 0", f"{timeline.TIMED}16 MiB"))
    one: list = []
    for turn, (push_ms, heard_ms) in enumerate([(50.0, 20.0), (8.0, 0.3), (9.0, 0.4), (10.0, 0.5)]):
        mine, theirs = _turn(100.0 * (turn + 1), push_ms, heard_ms)
        zero += mine
        one += theirs
    zero.append((1000.0, "rank 0", timeline.UNTIMED))
    zero.append((1001.0, "rank 0", timeline.PUSH_START))  # untimed again: not counted
    _write(tmp_path, "rank0-1.txt", zero)
    _write(tmp_path, "rank1-2.txt", one)

    kinds = timeline.stretches(timeline.read(tmp_path))
    assert set(kinds) == {"16 MiB"}
    assert {name: len(runs) for name, runs in kinds["16 MiB"].items()} == {
        "push": 4,
        "hand-made": 4,
    }

    push = timeline.medians(kinds["16 MiB"]["push"])  # turn 0 left out: it warms up
    assert [(who, what, count) for _, who, what, count in push] == [
        ("rank 0", timeline.PUSH_START, 3),
        ("rank 0", "said ROUND", 3),
        ("rank 1", "heard ROUND", 3),
        ("rank 1", "heard ROUND #2", 3),
        ("rank 0", "push returned", 3),
    ]
    ms = {what: value for value, _, what, _ in push}
    assert ms["heard ROUND"] == pytest.approx(0.4)
    assert ms["heard ROUND #2"] == pytest.approx(1.4)
    assert ms["push returned"] == pytest.approx(9.0)
    hand = timeline.medians(kinds["16 MiB"]["hand-made"])
    assert [(value, what) for value, _, what, _ in hand][:2] == [
        (0.0, timeline.HAND_START),
        (pytest.approx(5.0), "hand-made: shares came"),
    ]

    table = timeline.summary(tmp_path)
    assert "16 MiB, push (4 turns; medians, ms after its start):" in table
    assert "   0.400  rank 1  heard ROUND  (3)" in table


def test_without_the_folder_nothing_is_installed_or_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert timeline.install("rank 0") is False
    timeline.mark("anything")
    assert timeline._events == []
