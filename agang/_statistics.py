"""Counters a gang keeps about its ops, and the frozen snapshot users read."""

from __future__ import annotations

import collections
import statistics as _stats
from dataclasses import dataclass


@dataclass(frozen=True)
class GangStatistics:
    """A snapshot of a gang's counters, from :meth:`agang.Gang.statistics`.

    Latency quantiles are in seconds over the most recent completed ops (up to 1,024),
    from issue to completion; None before the first op completes.
    """

    num_issued: int
    num_completed: int
    num_failed: int
    num_timed_out: int
    num_in_flight: int
    bytes_issued: int
    bytes_in_flight: int
    latency_p50: float | None
    latency_p90: float | None
    latency_p99: float | None
    latency_max: float | None


class Counters:
    """The mutable counters behind :class:`GangStatistics`; the caller holds a lock."""

    def __init__(self, window: int = 1024) -> None:
        self.num_issued = 0
        self.num_completed = 0
        self.num_failed = 0
        self.num_timed_out = 0
        self.bytes_issued = 0
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)

    def snapshot(self, *, num_in_flight: int, bytes_in_flight: int) -> GangStatistics:
        latencies = sorted(self.latencies)
        p50 = p90 = p99 = top = None
        if latencies:
            if len(latencies) > 1:
                cuts = _stats.quantiles(latencies, n=100, method="inclusive")
                p50, p90, p99 = cuts[49], cuts[89], cuts[98]
            else:
                p50 = p90 = p99 = latencies[0]
            top = latencies[-1]
        return GangStatistics(
            num_issued=self.num_issued,
            num_completed=self.num_completed,
            num_failed=self.num_failed,
            num_timed_out=self.num_timed_out,
            num_in_flight=num_in_flight,
            bytes_issued=self.bytes_issued,
            bytes_in_flight=bytes_in_flight,
            latency_p50=p50,
            latency_p90=p90,
            latency_p99=p99,
            latency_max=top,
        )
