"""The scheduler's core: which ops are in flight, which may start now, which are late.

Pure: no threads, no clocks, no c10d. The engine (the driver, ``engine``) feeds it plain
data under its lock, starts what it hands back, and reads the time itself. Tests drive
it directly.

Rules:
1. Ops are admitted in sequence order and start in that order: an op never starts
   before an op admitted earlier on the same gang (issue order = call order).
2. The queue's first op starts when all of these hold:
   a. it is *ready* (its order check, if any, has passed);
   b. the gate is open: no two-phase op (object collectives) is between its phases;
   c. the started ops leave room for it: fewer than ``max_ops`` started, and its bytes
      fit under ``max_bytes`` -- or nothing at all is started, so an op bigger than the
      byte bound still runs, alone, instead of waiting for ever.
3. An op leaves the core once, when it finishes (with any outcome, started or not).
   Finishing a started op frees its room; finishing a queued one (the gang broke or
   closed) only removes it.
4. Deadlines sit in a *timeline*, a queue of entries in deadline order, with lazy
   deletion: an op whose deadline is no earlier than the last one's (every op with the
   gang's default timeout: issue times only grow) is appended, O(1); any other goes to
   a heap ordered by time. ``due(now)`` pops the ops whose deadline has passed and that
   are still in flight, each at most once, from both. Finished ops leave the timeline's
   front as they finish (in order, the usual case, one pop each); both are compacted
   whenever they hold more than twice the ops in flight (plus a floor), so finished
   ops' deadlines cost O(in flight) memory, not O(ops issued within one deadline).
   ``next_deadline()`` is the single time the driver's one timer must fire at.
5. The flight recorder keeps the last ``history`` finished ops, oldest first, so a
   timeout can show what this rank completed last, next to what it still has in flight.
   It keeps plain tuples; ``recent()`` makes them records, when a timeout asks.
6. Each op carries its number among the gang's collectives (-1 for a point-to-point
   op), in flight and in the recorder, so a peer's blame can be answered by that number
   (``standing``): it is equal on every rank where sequence numbers may not be.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Below this many stale deadlines the heap is left alone (rule 4).
_COMPACT_FLOOR = 64


@dataclass(eq=False, slots=True)
class Entry:
    """One admitted op, as the core sees it."""

    seq: int
    op: str
    num_bytes: int
    issued_at: float
    deadline: float | None
    start: Callable[[], None]
    item: Any = None  # the driver's own object for this op (its handle)
    ready: bool = True
    check_index: int | None = None  # its order check's position, when checked
    holds_gate: bool = False
    started: bool = False
    expired: bool = False
    collective: int = -1  # its number among the gang's collectives; -1: point-to-point
    # Its call for a peer's blame: a fingerprint (``agang._engine.ops``), text made only
    # when asked; None where its caller gave none.
    fingerprint: str | Callable[[], str] | None = None


def _deadline_of(entry: Entry) -> float:
    return entry.deadline if entry.deadline is not None else float("inf")


@dataclass(frozen=True)
class Record:
    """A finished op, kept by the flight recorder."""

    seq: int
    op: str
    num_bytes: int
    seconds: float
    outcome: str  # "ok", "failed", "timed out", "abandoned"
    collective: int = -1  # as ``Entry.collective``

    def describe(self) -> str:
        milliseconds = 1000 * self.seconds
        return f"{self.op} seq={self.seq} {self.num_bytes} B {milliseconds:.1f} ms {self.outcome}"


@dataclass
class Scheduler:
    """In-flight registry, start queue, deadline heap and flight recorder of one gang."""

    max_ops: int
    max_bytes: int
    history: int = 32
    entries: dict[int, Entry] = field(default_factory=dict)
    num_started: int = 0
    bytes_started: int = 0
    bytes_in_flight: int = 0
    _queue: collections.deque[Entry] = field(default_factory=collections.deque)
    _gate_holder: int | None = None
    _timeline: collections.deque[Entry] = field(default_factory=collections.deque)
    _deadlines: list[tuple[float, int]] = field(default_factory=list)
    # (seq, op, num_bytes, seconds, outcome, collective): Record's fields, made a Record
    # when read.
    _recent: collections.deque[tuple[int, str, int, float, str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self._recent = collections.deque(maxlen=self.history)

    # Admission and starting (rules 1 and 2).

    @property
    def num_in_flight(self) -> int:
        return len(self.entries)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def is_full(self, num_bytes: int) -> bool:
        """True when admitting ``num_bytes`` more would pass a bound (rule 2c).

        Counts every admitted op, started or queued: for callers that would rather be
        refused, or wait, than queue.
        """
        if not self.entries:
            return False
        return (
            len(self.entries) >= self.max_ops or self.bytes_in_flight + num_bytes > self.max_bytes
        )

    def admit(self, entry: Entry) -> None:
        """Queues ``entry``; ``take_next`` hands it back when it may start."""
        self._register(entry)
        self._queue.append(entry)

    def may_start(self, num_bytes: int) -> bool:
        """Whether an op of ``num_bytes`` admitted now would start at once (rule 2): none
        queued ahead of it, the gate open, room."""
        if self._queue or self._gate_holder is not None:
            return False
        if self.num_started == 0:
            return True
        return self.num_started < self.max_ops and self.bytes_started + num_bytes <= self.max_bytes

    def admit_started(self, entry: Entry) -> None:
        """Admits an op the driver has started already, as ``may_start`` allowed."""
        self._register(entry)
        entry.started = True
        self.num_started += 1
        self.bytes_started += entry.num_bytes
        if entry.holds_gate:
            self._gate_holder = entry.seq

    def record(
        self, seq: int, op: str, num_bytes: int, seconds: float, outcome: str, collective: int = -1
    ) -> None:
        """Records an op that never entered the core: the driver started it as
        ``may_start`` allowed and it ended before the driver let go (rule 5)."""
        self._recent.append((seq, op, num_bytes, seconds, outcome, collective))

    def _register(self, entry: Entry) -> None:
        seq = entry.seq
        entries = self.entries
        if seq in entries:
            raise ValueError(f"seq {seq} is already in flight")
        entries[seq] = entry
        self.bytes_in_flight += entry.num_bytes
        deadline = entry.deadline
        if deadline is not None:
            timeline = self._timeline
            if not timeline or timeline[-1].deadline <= deadline:  # type: ignore[operator]
                timeline.append(entry)
            else:
                heapq.heappush(self._deadlines, (deadline, seq))

    def set_ready(self, seq: int) -> None:
        entry = self.entries.get(seq)
        if entry is not None:
            entry.ready = True

    def release_gate(self, seq: int) -> None:
        if self._gate_holder == seq:
            self._gate_holder = None

    def _has_room(self, entry: Entry) -> bool:
        if self.num_started == 0:
            return True
        return (
            self.num_started < self.max_ops
            and self.bytes_started + entry.num_bytes <= self.max_bytes
        )

    def take_next(self) -> Entry | None:
        """Pops the op that may start now, marked started; None if none may (rule 2)."""
        if not self._queue or self._gate_holder is not None:
            return None
        entry = self._queue[0]
        if not entry.ready or not self._has_room(entry):
            return None
        self._queue.popleft()
        entry.started = True
        self.num_started += 1
        self.bytes_started += entry.num_bytes
        if entry.holds_gate:
            self._gate_holder = entry.seq
        return entry

    # Finishing (rule 3) and the recorder (rule 5).

    def finish(self, seq: int, *, seconds: float, outcome: str) -> Entry | None:
        """Removes a finished op; returns it, or None if it had already left."""
        entry = self.entries.pop(seq, None)
        if entry is None:
            return None
        self.bytes_in_flight -= entry.num_bytes
        if entry.started:
            self.num_started -= 1
            self.bytes_started -= entry.num_bytes
        elif entry in self._queue:  # a dropped op is no longer queued
            self._queue.remove(entry)
        if self._gate_holder == seq:
            self._gate_holder = None
        self._recent.append((seq, entry.op, entry.num_bytes, seconds, outcome, entry.collective))
        timeline = self._timeline
        if timeline:
            while timeline and timeline[0].seq not in self.entries:  # in order: one pop
                timeline.popleft()
            limit = 2 * len(self.entries) + _COMPACT_FLOOR
            if len(timeline) > limit or len(self._deadlines) > limit:
                self._compact_deadlines()
        elif len(self._deadlines) > 2 * len(self.entries) + _COMPACT_FLOOR:
            self._compact_deadlines()
        return entry

    def drop_queued(self) -> list[Entry]:
        """Empties the queue (the gang broke or closed); returns the ops it held."""
        dropped = list(self._queue)
        self._queue.clear()
        self._gate_holder = None
        return dropped

    def standing(
        self, number: int, collective: bool
    ) -> tuple[bool, str | None, str | Callable[[], str] | None]:
        """Whether the op numbered ``number`` (its sequence number, or with ``collective``
        its number among collectives: rule 6) is in flight, its name where this rank
        issued it and still knows it (the flight recorder's), and its fingerprint while
        in flight (None else); for a peer's blame."""
        if collective:
            for entry in self.entries.values():  # a blame's rare question: a scan will do
                if entry.collective == number:
                    return True, entry.op, entry.fingerprint
        else:
            found = self.entries.get(number)
            if found is not None:
                return True, found.op, found.fingerprint
        position = 5 if collective else 0
        for fields in reversed(self._recent):
            if fields[position] == number:
                return False, fields[1], None
        return False, None, None

    def recent(self) -> list[Record]:
        return [Record(*fields) for fields in self._recent]

    # Deadlines (rule 4).

    def _pending(self, entry: Entry) -> bool:
        """Whether ``entry``'s deadline is still to be watched: in flight, not expired."""
        return self.entries.get(entry.seq) is entry and not entry.expired

    def _compact_deadlines(self) -> None:
        """Drops the deadlines of ops no longer in flight (rule 4); amortized O(1)."""
        self._timeline = collections.deque(e for e in self._timeline if self._pending(e))
        live = []
        for deadline, seq in self._deadlines:
            entry = self.entries.get(seq)
            if entry is not None and not entry.expired:
                live.append((deadline, seq))
        heapq.heapify(live)
        self._deadlines = live

    def next_deadline(self) -> float | None:
        timeline = self._timeline
        while timeline and not self._pending(timeline[0]):
            timeline.popleft()
        first = timeline[0].deadline if timeline else None
        while self._deadlines:
            deadline, seq = self._deadlines[0]
            entry = self.entries.get(seq)
            if entry is not None and not entry.expired:
                return deadline if first is None or deadline < first else first
            heapq.heappop(self._deadlines)
        return first

    def due(self, now: float) -> list[Entry]:
        """Pops the ops whose deadline is at or before ``now``, marked expired, in
        deadline order."""
        late = []
        timeline = self._timeline
        while timeline and timeline[0].deadline <= now:  # type: ignore[operator]
            entry = timeline.popleft()
            if self._pending(entry):
                late.append(entry)
        from_heap = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq = heapq.heappop(self._deadlines)
            found = self.entries.get(seq)
            if found is not None and not found.expired:
                from_heap.append(found)
        if from_heap:  # an entry is in the timeline or the heap, never both
            late = sorted(late + from_heap, key=_deadline_of)
        for entry in late:
            entry.expired = True
        return late

    def describe_in_flight(self, now: float, *, skip: int | None = None) -> list[str]:
        lines = []
        for entry in self.entries.values():
            if entry.seq == skip:
                continue
            state = "started" if entry.started else ("queued" if entry.ready else "checking")
            lines.append(
                f"{entry.op} seq={entry.seq} {entry.num_bytes} B {state}, "
                f"issued {now - entry.issued_at:.3f} s ago"
            )
        return lines
