"""Counters a gang keeps about its ops, and the frozen snapshot users read."""

from __future__ import annotations

import collections
import statistics as _stats
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_WINDOW = 1024


@dataclass(frozen=True)
class Quantiles:
    """Seconds over a window of recent samples (up to 1,024)."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(samples: Iterable[float]) -> Quantiles | None:
        """The quantiles of ``samples``, or None when there are none."""
        ordered = sorted(samples)
        if not ordered:
            return None
        if len(ordered) == 1:
            only = ordered[0]
            return Quantiles(1, only, only, only, only)
        cuts = _stats.quantiles(ordered, n=100, method="inclusive")
        return Quantiles(len(ordered), cuts[49], cuts[89], cuts[98], ordered[-1])


@dataclass(frozen=True)
class GangStatistics:
    """A snapshot of a gang's counters, from [`agang.Gang.statistics`][agang.Gang.statistics].

    Ops are counted as the backend sees them: a coalesce scope or a bucket that folds
    n all-reduces into one flat op counts one issued op and n ``num_coalesced``.

    Attributes:
        num_issued: Ops issued since the gang was made.
        num_completed: Ops that finished successfully.
        num_failed: Ops that failed (including those abandoned when the gang broke).
        num_timed_out: Ops whose deadline passed.
        num_coalesced: User all-reduces folded into flat ops.
        num_in_flight: Ops issued and not finished (started or queued).
        num_queued: Of those, ops waiting for room under the gang's in-flight bounds
            (or for their order check) and not yet started in the backend.
        bytes_issued: Bytes of all ops issued.
        bytes_in_flight: Bytes of the ops in flight.
        latency_*: Issue-to-completion seconds over recent ops of every kind.
        latency_by_op: The same, per op name.
        loop_lag: Seconds between an op finishing and the task awaiting it running
            again, and how late the gang's deadline timer fired: how busy (or blocked)
            the event loop was while it had ops to wait for. None before any sample.
    """

    num_issued: int
    num_completed: int
    num_failed: int
    num_timed_out: int
    num_coalesced: int
    num_in_flight: int
    num_queued: int
    bytes_issued: int
    bytes_in_flight: int
    latency_p50: float | None
    latency_p90: float | None
    latency_p99: float | None
    latency_max: float | None
    latency_by_op: Mapping[str, Quantiles] = field(default_factory=dict)
    loop_lag: Quantiles | None = None


class Counters:
    """The mutable counters behind [`GangStatistics`][agang.GangStatistics]; the caller holds a
    lock."""

    def __init__(self, window: int = _WINDOW) -> None:
        self.num_issued = 0
        self.num_completed = 0
        self.num_failed = 0
        self.num_timed_out = 0
        self.num_coalesced = 0
        self.bytes_issued = 0
        self._window = window
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)
        self.latencies_by_op: dict[str, collections.deque[float]] = {}
        self.lags: collections.deque[float] = collections.deque(maxlen=window)

    def completed(self, op: str, seconds: float) -> None:
        self.num_completed += 1
        self.latencies.append(seconds)
        window = self.latencies_by_op.get(op)
        if window is None:
            window = self.latencies_by_op[op] = collections.deque(maxlen=self._window)
        window.append(seconds)

    def snapshot(
        self, *, num_in_flight: int, num_queued: int, bytes_in_flight: int
    ) -> GangStatistics:
        overall = Quantiles.of(self.latencies)
        by_op = {op: Quantiles.of(window) for op, window in self.latencies_by_op.items()}
        return GangStatistics(
            num_issued=self.num_issued,
            num_completed=self.num_completed,
            num_failed=self.num_failed,
            num_timed_out=self.num_timed_out,
            num_coalesced=self.num_coalesced,
            num_in_flight=num_in_flight,
            num_queued=num_queued,
            bytes_issued=self.bytes_issued,
            bytes_in_flight=bytes_in_flight,
            latency_p50=overall.p50 if overall else None,
            latency_p90=overall.p90 if overall else None,
            latency_p99=overall.p99 if overall else None,
            latency_max=overall.max if overall else None,
            latency_by_op={op: q for op, q in by_op.items() if q is not None},
            loop_lag=Quantiles.of(self.lags),
        )
