"""Where a sharded push's time goes: ``bench_weights.py --sharded --timeline DIR``.

Each process of the sharded bench (the trainer's two ranks and the server) wraps a few
of agang's functions with a timestamp at their call or return, and writes what it saw
under ``DIR`` at its end; the bench's own process then lines the three up. The clock is
``time.perf_counter_ns``, which on Linux is ``CLOCK_MONOTONIC``: one clock for every
process of a machine, so the offsets compare across processes. The wrappers cost a few
microseconds each, a dozen a push: take the ratio from a run without ``--timeline``.

What is marked, and by whom:

- ``rank 0``: ``push called`` and ``push returned``; its round begun (past the push's
  checks and admission) and ended (every server's confirmation in); the push's end on
  the lane begun (``ending``, the report made) and done; each word said to the other
  trainer ranks (``said ROUND``, ``said DONE``, once the send is issued); each bucket's
  shares asked for (``take N``) and come (``bucket N gathered``); each broadcast to the
  fleet issued; and, marked by the bench itself, the hand-made round's start
  (``hand-made: start``), its shares come, and its broadcast and barrier ended.
- ``rank 1``: each word heard from rank 0 (``heard ROUND``, ``heard DONE``), the round's
  shares begun (``sending shares``), each bucket's batch of them issued (``shares
  issued``, once c10d took them), and the round's last share sent.
- ``server``: each round's bucket 0 come (``bucket 0 landed``), and each confirmation
  issued (``confirmation sent``).
- every process: each batch of point-to-point transfers (a word, a bucket's shares, a
  confirmation) as soon as c10d's waiter thread learned that it ended (``c10d thread:
  N transfers ended``), before agang reports it to the task that awaits it: the gap to
  the task's next mark is that task's event loop being woken.

The summary, per model size: for each mark, its median over the timed turns (turn 0
left out) of the time after rank 0's ``push called`` (for the hand-made round's marks,
after its start), in time order, with how many turns had it. The n-th time a mark
comes in one turn is a mark of its own (``#n``).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import on_transfers_ended

#: The environment variable that carries ``--timeline``'s folder to the processes.
ENV = "AGANG_BENCH_TIMELINE"
#: The marks that start a push's and a hand-made round's stretch of the timeline.
PUSH_START = "push called"
HAND_START = "hand-made: start"
#: Rank 0's marks around a size's timed turns (the bench's).
TIMED = "timed "
UNTIMED = "untimed"
#: The first stretches of each kind left out: turn 0, which warms up.
WARM = 1

_events: list[tuple[int, str, str]] = []
_role = ""


def mark(what: str) -> None:
    """Notes ``what`` now, for this process (a no-op unless ``install`` ran)."""
    if _role:
        _events.append((time.perf_counter_ns(), _role, what))


def install(role: str) -> bool:
    """Wraps agang's functions in this process, as ``role`` (``rank 0``, ``rank 1``,
    ``server``), where ``--timeline`` was given; whether it did."""
    global _role
    if not os.environ.get(ENV) or _role:
        return bool(_role)
    _role = role
    from agang._collective.process_group_gang import ProcessGroupGang
    from agang._weights import following, gathering, service

    modules: dict[str, Any] = {"following": following, "service": service}  # patched
    on_transfers_ended(lambda count: mark(f"c10d thread: {count} transfers ended"))
    from agang._weights.publisher import WeightPublisher

    kinds = {gathering.ROUND: "ROUND", gathering.DONE: "DONE"}

    def kind(word: Any) -> str:
        return kinds.get(gathering.read_control(word)[0], "another word")

    def after(owner: Any, name: str, what: Callable[..., str]) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            mark(what(*args, **kwargs))
            return out

        setattr(owner, name, wrapped)

    def around(owner: Any, name: str, first: Callable[..., str], last: Callable[..., str]) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        async def wrapped(*args: Any, **kwargs: Any) -> Any:
            mark(first(*args, **kwargs))
            out = await inner(*args, **kwargs)
            mark(last(*args, **kwargs))
            return out

        setattr(owner, name, wrapped)

    if role == "rank 0":
        around(WeightPublisher, "push", lambda *a, **k: PUSH_START, lambda *a, **k: "push returned")
        after(gathering.Gathering, "_say", lambda self, word, seconds: f"said {kind(word)}")
        around(
            gathering.Gathering,
            "take",
            lambda self, index, *a: f"take {index}",
            lambda self, index, *a: f"bucket {index} gathered",
        )
        after(ProcessGroupGang, "broadcast", lambda *a, **k: "broadcast issued")
        around(
            WeightPublisher,
            "_round_with_recovery",
            lambda *a, **k: "round begun",
            lambda *a, **k: "round ended",
        )
        around(gathering.Gathering, "end", lambda *a, **k: "ending", lambda *a, **k: "ended")
    elif role == "rank 1":
        read = modules["following"].read_control

        def heard(word: Any) -> Any:
            out = read(word)
            mark(f"heard {kinds.get(out[0], 'another word')}")
            return out

        modules["following"].read_control = heard
        after(ProcessGroupGang, "exchange", lambda *a, **k: "shares issued")
        around(
            following.Following,
            "_send_round",
            lambda *a, **k: "sending shares",
            lambda *a, **k: "last share sent",
        )
    else:
        header_of = modules["service"].header_of

        def landed(bucket: Any) -> Any:
            mark("bucket 0 landed")
            return header_of(bucket)

        modules["service"].header_of = landed
        after(ProcessGroupGang, "send", lambda *a, **k: "confirmation sent")
    return True


def dump() -> None:
    """Writes this process's marks under ``--timeline``'s folder."""
    folder = os.environ.get(ENV)
    if not folder or not _role:
        return
    path = Path(folder) / f"{_role.replace(' ', '')}-{os.getpid()}.txt"
    path.write_text("".join(f"{at}\t{who}\t{what}\n" for at, who, what in _events))


def read(folder: Path) -> list[tuple[int, str, str]]:
    """Every process's marks under ``folder``, in time order."""
    events = []
    for path in sorted(folder.glob("*.txt")):
        for line in path.read_text().splitlines():
            at, who, what = line.split("\t")
            events.append((int(at), who, what))
    return sorted(events)


def stretches(
    events: list[tuple[int, str, str]],
) -> dict[str, dict[str, list[list[tuple[float, str, str]]]]]:
    """Per size and kind (``push``, ``hand-made``), each stretch of the timed turns (from
    rank 0's ``timed SIZE`` mark to its ``untimed``): the marks from the stretch's start
    to the next one's, as (milliseconds after its start, who, what)."""
    out: dict[str, dict[str, list[list[tuple[float, str, str]]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    size: str | None = None
    start, current = 0, None  # type: tuple[int, list[tuple[float, str, str]] | None]
    for at, who, what in events:
        if who == "rank 0" and what.startswith(TIMED):
            size, current = what[len(TIMED) :], None
            continue
        if who == "rank 0" and what == UNTIMED:
            size = current = None
            continue
        if size is not None and who == "rank 0" and what in (PUSH_START, HAND_START):
            current = []
            out[size]["push" if what == PUSH_START else "hand-made"].append(current)
            start = at
        if current is not None:
            current.append(((at - start) / 1e6, who, what))
    return out


def medians(runs: list[list[tuple[float, str, str]]]) -> list[tuple[float, str, str, int]]:
    """Each mark's median time over ``runs`` (the n-th of a mark in a stretch is its
    own mark), with how many runs had it, in time order; the first ``WARM`` runs are
    left out, where there are more."""
    kept = runs[WARM:] if len(runs) > WARM else runs
    seen: dict[tuple[str, str], list[float]] = defaultdict(list)
    for run in kept:
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for ms, who, what in run:
            counts[(who, what)] += 1
            n = counts[(who, what)]
            seen[(who, what if n == 1 else f"{what} #{n}")].append(ms)
    rows = [(statistics.median(v), who, what, len(v)) for (who, what), v in seen.items()]
    return sorted(rows)


def summary(folder: Path) -> str:
    """The timeline's table, per size and kind."""
    lines = []
    for size, kinds in stretches(read(folder)).items():
        for name, runs in kinds.items():
            lines.append(f"{size}, {name} ({len(runs)} turns; medians, ms after its start):")
            for ms, who, what, count in medians(runs):
                lines.append(f"  {ms:8.3f}  {who:<7} {what}  ({count})")
    return "\n".join(lines)
