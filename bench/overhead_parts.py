"""The engine's parts alone, for ``bench_overhead.py``: each step of issuing one op,
timed by calling the real internal function in a loop (on an asyncio loop, where the
deadline check is armed). What each costs, not how they add up: the whole path is
``bench_overhead.py``'s stages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import torch

import agang
from agang._engine import busy
from agang._engine.scheduler import Entry
from agang._handle import issued

# Part name -> per-op nanoseconds, one figure per round.
Parts = dict[str, list[float]]


def _parts(gang: agang.FakeGang, tensor: torch.Tensor) -> dict[str, Callable[[int], int]]:
    engine = gang._engine
    lock = engine.lock
    counters = engine._counters
    scheduler = engine._scheduler

    def validation(count: int) -> int:
        check = gang._group.tensor
        start = time.perf_counter_ns()
        for _ in range(count):
            check(tensor, "tensor")
        return time.perf_counter_ns() - start

    def lock_taken(count: int) -> int:
        start = time.perf_counter_ns()
        for _ in range(count):
            with lock:
                pass
        return time.perf_counter_ns() - start

    def busy_claim(count: int) -> int:
        holder = object()
        start = time.perf_counter_ns()
        for _ in range(count):
            busy.release(busy.acquire_one("tensor", tensor, holder))
        return time.perf_counter_ns() - start

    def handle(count: int) -> int:
        start = time.perf_counter_ns()
        for seq in range(count):
            issued("all_reduce", seq, 4, 300.0, engine, seq)
        return time.perf_counter_ns() - start

    def deadline(count: int) -> int:
        due = time.monotonic() + 300.0
        engine._alarm.arm(due)
        start = time.perf_counter_ns()
        for _ in range(count):
            engine._alarm.arm(due)  # a later deadline than the armed one: the usual case
        return time.perf_counter_ns() - start

    def admission(count: int) -> int:
        # What an op that outlives its start adds (a real backend's): it enters the
        # core as started, with its deadline, and leaves it when it ends.
        now = time.monotonic()
        base = 1 << 40  # seqs no real op uses
        start = time.perf_counter_ns()
        for seq in range(base, base + count):
            with lock:
                assert scheduler.may_start(4)
                scheduler.admit_started(Entry(seq, "all_reduce", 4, now, now + 300.0, _nothing))
            with lock:
                scheduler.finish(seq, seconds=0.0, outcome="ok")
        return time.perf_counter_ns() - start

    def counting(count: int) -> int:
        # Under the lock the engine holds anyway: issued, completed, the recorder.
        start = time.perf_counter_ns()
        for seq in range(count):
            with lock:
                counters.num_issued += 1
                counters.bytes_issued += 4
                counters.completed("all_reduce", 1e-6)
                scheduler.record(seq, "all_reduce", 4, 1e-6, "ok")
        return time.perf_counter_ns() - start

    return {
        "validation": validation,
        "engine lock taken once": lock_taken,
        "busy claim + release": busy_claim,
        "handle made": handle,
        "deadline armed": deadline,
        "statistics and flight recorder": counting,
        "core entry (an op outliving its start)": admission,
    }


def _nothing() -> None:
    pass


def measure(rounds: int, batch: int) -> Parts:
    """Each part's per-op nanoseconds, one figure per round, on an asyncio loop."""
    gang = agang.FakeGang(rank=0, size=2, op_timeout=300.0)
    tensor = torch.zeros(1)
    parts = _parts(gang, tensor)
    figures: Parts = {name: [] for name in parts}

    async def one_round(index: int) -> None:
        names = list(parts)
        first = index % len(names)
        for name in names[first:] + names[:first]:
            parts[name](batch)  # warm-up
            figures[name].append(parts[name](batch) / batch)

    for index in range(rounds):
        asyncio.run(one_round(index))
    gang.close_sync()
    return figures
