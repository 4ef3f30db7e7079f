"""Scheduler benchmark: coalescing, event-loop lag with many ops in flight, order checks.

Method:
    Two ranks run as real processes on 127.0.0.1 over Gloo (``agang.testing.run_world``);
    both run the same fixed sequence of ops, and rank 0's numbers are reported (rank 1's
    are in the JSON file). Modes are interleaved round-robin, their order rotated each round,
    with a raw ``dist.barrier()`` before each timed batch, so drift and background load
    hit them alike. Compare ratios within one run: absolute times here are noisy.

    1. Coalescing: 64 all-reduces of float32[1024] (4 KiB), timed as a whole per batch:
       raw c10d one by one; agang awaited one by one; agang all issued, then awaited in
       order; agang in one ``coalesce()`` scope; and by hand (``torch.cat``, one raw
       all-reduce, copy back with ``split`` + ``copy_``; all of it timed). Round 0 is a
       discarded warm-up.
    2. Loop lag: a ticker task sleeps 1 ms at a time on the loop and records how late
       it wakes, while the loop issues N all-reduces (N = 1, 100, 1000; 4 KiB and
       256 KiB) and awaits them in order, repeated until about 1000 ops ran per cell
       (300 with --quick, which also measures 4 KiB only).
       agang (``gang.all_reduce``) against raw c10d (``async_op=True``, each
       ``work.wait`` run by ``loop.run_in_executor`` on an 8-thread pool), each on
       asyncio and uvloop, each cell on a fresh loop. "idle" is the ticker alone.
       The gang checks no order there; the agang cells run again in the first phase
       that checks it (part 3), to show what Gloo's default costs the loop.
    3. Order checking: the ranks re-initialize the gang in phases alternating
       ``check_order=False`` / ``True`` (off, on, off, on; samples pooled per setting)
       and time single all-reduces (4 B, 4 KiB) and the 64 x 4 KiB batch (issued then
       awaited, and coalesced).

Usage:
    python bench/bench_scheduler.py            # full run, about 4 minutes
    python bench/bench_scheduler.py --quick    # smoke test, under a minute
    python bench/bench_scheduler.py --coalescing-only 40   # part 1 alone, 40 rounds
    python bench/bench_scheduler.py --smoke    # every part once, tiny: for tests

Writes ``bench/out/scheduler.json`` (``--out DIR``: elsewhere), then plots
(``plot_scheduler.py``) ``coalesce.png`` and ``scheduler_lag.png`` from it, where
matplotlib is installed. Latency against message size is ``bench_latency.py``'s
``latency.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import _common
import plot_scheduler
import torch
import torch.distributed as dist
import uvloop
from _common import format_bytes, percentile

import agang
from agang.testing import run_world

NUMEL = 1024  # float32[1024] = 4 KiB
BATCH = 64
TICK = 1e-3
POOL_THREADS = 8
LAG_COUNTS = (1, 100, 1000)
IDLE_SECONDS = 0.25
COALESCE_TARGET = 20.0  # raw one by one / coalesce, at least
FLAT_TARGET = 1.5  # coalesce / hand-flattened, at most
LAG_TARGET = 10e-3  # agang p99 lag at 1000 in flight, at most

Samples = dict[str, list[float]]
Mode = Callable[[agang.Gang, list[torch.Tensor]], Awaitable[None]]


@dataclass(frozen=True)
class Plan:
    coalesce_rounds: int  # plus one warm-up round
    lag_rounds: int
    lag_sizes: tuple[int, ...]  # bytes per all-reduce
    lag_ops: int  # a cell repeats its batch of N until about this many ops ran
    order_phases: int  # off, on, off, on, ...
    order_rounds: int  # per phase
    order_singles: int  # timed single ops per mode and round (after one warm-up)
    order_batches: int  # timed batches per mode and round (after one warm-up)
    coalescing_only: bool = False  # part 1 alone (--coalescing-only)


PLANS = {
    False: Plan(coalesce_rounds=60, lag_rounds=3, lag_sizes=(4096, 256 * 1024), lag_ops=1000,
                order_phases=4, order_rounds=15, order_singles=30, order_batches=2),
    True: Plan(coalesce_rounds=10, lag_rounds=1, lag_sizes=(4096,), lag_ops=300,
               order_phases=2, order_rounds=4, order_singles=20, order_batches=1),
}  # fmt: skip
# --smoke: the smallest run that prints every table and writes every file, for tests.
SMOKE_PLAN = Plan(coalesce_rounds=1, lag_rounds=1, lag_sizes=(4096,), lag_ops=4,
                  order_phases=2, order_rounds=1, order_singles=2, order_batches=1)  # fmt: skip


def _rotated(names: list[str], index: int) -> list[str]:
    start = index % len(names)
    return names[start:] + names[:start]


# 1. Coalescing: each mode runs the 64 all-reduces once.


async def _raw_one_by_one(gang: agang.Gang, ts: list[torch.Tensor]) -> None:
    for t in ts:
        dist.all_reduce(t)


async def _agang_one_by_one(gang: agang.Gang, ts: list[torch.Tensor]) -> None:
    for t in ts:
        await gang.all_reduce(t)


async def _agang_issued(gang: agang.Gang, ts: list[torch.Tensor]) -> None:
    handles = [gang.all_reduce(t) for t in ts]
    for handle in handles:
        await handle


async def _agang_coalesced(gang: agang.Gang, ts: list[torch.Tensor]) -> None:
    with gang.coalesce() as batch:
        for t in ts:
            _ = gang.all_reduce(t)  # awaited through the scope
    await batch  # one wait for the scope (each handle could be awaited too)


async def _hand_flattened(gang: agang.Gang, ts: list[torch.Tensor]) -> None:
    flat = torch.cat(ts)
    dist.all_reduce(flat)
    for t, part in zip(ts, torch.split(flat, [t.numel() for t in ts]), strict=True):
        t.copy_(part)


RAW_ONE_BY_ONE, COALESCED, HAND_FLAT = "c10d one by one", "agang coalesce()", "hand-flattened"
COALESCE_MODES: dict[str, Mode] = {
    RAW_ONE_BY_ONE: _raw_one_by_one,
    "agang one by one": _agang_one_by_one,
    "agang issued, awaited": _agang_issued,
    COALESCED: _agang_coalesced,
    HAND_FLAT: _hand_flattened,
}


async def _time_batch(gang: agang.Gang, mode: Mode, ts: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    await mode(gang, ts)
    return time.perf_counter() - start


async def _coalescing(gang: agang.Gang, plan: Plan) -> tuple[Samples, float]:
    """Seconds per batch for each mode, and the ops agang issued per coalesce scope."""
    ts = [torch.zeros(NUMEL) for _ in range(BATCH)]
    names = list(COALESCE_MODES)
    samples: Samples = {name: [] for name in names}
    scopes, issued = 0, 0
    for index in range(plan.coalesce_rounds + 1):
        for name in _rotated(names, index):
            before = gang.statistics().num_issued
            seconds = await _time_batch(gang, COALESCE_MODES[name], ts)
            if index:
                samples[name].append(seconds)
            if name == COALESCED:
                scopes, issued = scopes + 1, issued + gang.statistics().num_issued - before
    return samples, issued / scopes


# 2. Loop lag: a ticker on the loop while the loop drives N ops in flight.


async def _ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(TICK)
        lags.append(time.perf_counter() - start - TICK)


async def _agang_in_flight(gang: agang.Gang, ts: list[torch.Tensor], _: Any) -> None:
    handles = [gang.all_reduce(t) for t in ts]
    for handle in handles:
        await handle


async def _pool_in_flight(gang: agang.Gang, ts: list[torch.Tensor], pool: Any) -> None:
    loop = asyncio.get_running_loop()
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    waits = [loop.run_in_executor(pool, work.wait) for work in works]
    for wait in waits:
        await wait


async def _lag_cell(gang: agang.Gang, ts: list[torch.Tensor], repeats: int, pooled: bool) -> Any:
    """Ticker lags and seconds per batch while ``repeats`` batches of ``ts`` run."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="bench-wait") as pool:
        # Start the pool's threads before the window opens.
        warm_up = [loop.run_in_executor(pool, time.sleep, 1e-3) for _ in range(POOL_THREADS)]
        await asyncio.gather(*warm_up)
        batch = _pool_in_flight if pooled else _agang_in_flight
        lags: list[float] = []
        stop = asyncio.Event()
        ticker = asyncio.create_task(_ticker(lags, stop))
        await asyncio.sleep(0)
        seconds = []
        for _ in range(repeats if ts else 0):
            start = time.perf_counter()
            await batch(gang, ts, pool)
            seconds.append(time.perf_counter() - start)
        if not ts:
            await asyncio.sleep(IDLE_SECONDS)
        stop.set()
        await ticker
    return lags, seconds


def _run_on(loop_name: str, coroutine: Coroutine[Any, Any, Any]) -> Any:
    factory = uvloop.new_event_loop if loop_name == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coroutine)


LAG_MODES = ("agang asyncio", "agang uvloop", "threads asyncio", "threads uvloop")
AGANG_LAG_MODES = LAG_MODES[:2]
IDLE = "idle"


def _loop_lag(gang: agang.Gang, plan: Plan, modes: tuple[str, ...] = LAG_MODES) -> dict[str, Any]:
    """Per cell ``"size/N/mode"``: ticker lags and batch seconds, pooled over rounds."""
    most = max(LAG_COUNTS)
    tensors = {size: [torch.zeros(size // 4) for _ in range(most)] for size in plan.lag_sizes}
    cells: dict[str, Any] = {}

    def run(key: str, ts: list[torch.Tensor], repeats: int, mode: str) -> None:
        dist.barrier()
        coroutine = _lag_cell(gang, ts, repeats, mode.startswith("threads"))
        lags, seconds = _run_on(mode.split()[-1], coroutine)
        cell = cells.setdefault(key, {"lags": [], "batch_seconds": []})
        cell["lags"] += lags
        cell["batch_seconds"] += seconds

    for index in range(plan.lag_rounds):
        run(IDLE, [], 0, "idle asyncio")
        for size in plan.lag_sizes:
            for count in LAG_COUNTS:
                repeats = max(1, plan.lag_ops // count)
                for mode in _rotated(list(modes), index):
                    run(f"{size}/{count}/{mode}", tensors[size][:count], repeats, mode)
    return cells


# 3. Order checking: the same ops with check_order off and on.


async def _order_phase(gang: agang.Gang, plan: Plan) -> Samples:
    singles = {"1 op, 4 B": torch.zeros(1), "1 op, 4 KiB": torch.zeros(NUMEL)}
    batches: dict[str, Mode] = {
        "64x4KiB issued": _agang_issued,
        "64x4KiB coalesce": _agang_coalesced,
    }
    ts = [torch.zeros(NUMEL) for _ in range(BATCH)]
    names = list(singles) + list(batches)
    samples: Samples = {name: [] for name in names}
    for index in range(plan.order_rounds):
        for name in _rotated(names, index):
            if name in singles:
                dist.barrier()
                for op in range(1 + plan.order_singles):
                    start = time.perf_counter()
                    await gang.all_reduce(singles[name])
                    if op:
                        samples[name].append(time.perf_counter() - start)
            else:
                for op in range(1 + plan.order_batches):
                    seconds = await _time_batch(gang, batches[name], ts)
                    if op:
                        samples[name].append(seconds)
    return samples


# One rank.


def _rank_main(plan: Plan) -> dict[str, Any]:
    """A rank's process: its own gangs, made sync, one per order-checking phase."""
    result: dict[str, Any] = {"order": {"off": {}, "on": {}}, "seconds": {}}

    @contextlib.contextmanager
    def timed(step: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            seconds = result["seconds"]
            seconds[step] = seconds.get(step, 0.0) + time.monotonic() - started

    if plan.coalescing_only:
        gang = agang.init_sync(in_process=False, timeout=60.0, op_timeout=120.0)
        try:
            result["coalesce"], result["ops_per_scope"] = asyncio.run(_coalescing(gang, plan))
        finally:
            gang.close_sync()
        return result
    for phase in range(plan.order_phases):
        check = phase % 2 == 1
        with timed("init"):
            gang = agang.init_sync(
                in_process=False, timeout=60.0, op_timeout=120.0, check_order=check
            )
        try:
            if phase == 0:
                with timed("coalescing"):
                    result["coalesce"], result["ops_per_scope"] = asyncio.run(
                        _coalescing(gang, plan)
                    )
                with timed("loop lag"):
                    result["lag"] = _loop_lag(gang, plan)
                result["statistics"] = asdict(gang.statistics())
            if phase == 1:  # the same cells, agang's only, on a gang that checks order
                with timed("loop lag, order checked"):
                    result["lag_checked"] = _loop_lag(gang, plan, AGANG_LAG_MODES)
            with timed("order checking"):
                samples = asyncio.run(_order_phase(gang, plan))
            for name, values in samples.items():
                result["order"]["on" if check else "off"].setdefault(name, []).extend(values)
        finally:
            with timed("close"):
                gang.close_sync()
    return result


# Reporting (rank 0 in the tables; both ranks in the JSON file).


@dataclass(frozen=True)
class Stats:
    count: int
    median: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values: list[float]) -> Stats:
        ordered = sorted(values)
        return Stats(
            len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 90),
            percentile(ordered, 99),
            ordered[-1],
        )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


@dataclass(frozen=True)
class Verdict:
    what: str
    value: float
    limit: str
    passed: bool


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    if "lag" not in result:  # --coalescing-only
        return {"coalesce": {name: asdict(Stats.of(v)) for name, v in result["coalesce"].items()}}
    return {
        "coalesce": {name: asdict(Stats.of(v)) for name, v in result["coalesce"].items()},
        "lag": {
            key: {
                "lag": asdict(Stats.of(cell["lags"])),
                "batch": asdict(Stats.of(cell["batch_seconds"])) if cell["batch_seconds"] else None,
            }
            for key, cell in result["lag"].items()
        },
        "lag_checked": {
            key: asdict(Stats.of(cell["lags"])) for key, cell in result["lag_checked"].items()
        },
        "order": {
            setting: {name: asdict(Stats.of(v)) for name, v in by_name.items()}
            for setting, by_name in result["order"].items()
        },
    }


def report_coalescing(summary: dict[str, Any], result: dict[str, Any]) -> list[Verdict]:
    coalesce = summary["coalesce"]
    print(f"1. Coalescing: {BATCH} all_reduces of 4 KiB, ms per batch (rank 0)\n")
    print(f"{'mode':<22} {'batches':>7} {'median':>8} {'p90':>8} {'vs coalesce':>12}")
    base = coalesce[COALESCED]["median"]
    for name, row in coalesce.items():
        print(
            f"{name:<22} {row['count']:>7} {ms(row['median']):>8} {ms(row['p90']):>8} "
            f"{row['median'] / base:>11.2f}x"
        )
    speedup = coalesce[RAW_ONE_BY_ONE]["median"] / base
    overhead = base / coalesce[HAND_FLAT]["median"]
    print(f"agang ops issued per coalesce() scope: {result['ops_per_scope']:g}")
    verdicts = [
        Verdict("c10d one by one / coalesce", speedup, f">= {COALESCE_TARGET:g}x",
                speedup >= COALESCE_TARGET),
        Verdict("coalesce / hand-flattened", overhead, f"<= {FLAT_TARGET:g}x",
                overhead <= FLAT_TARGET),
    ]  # fmt: skip
    return verdicts


def print_verdicts(verdicts: list[Verdict]) -> None:
    print("\nTargets (rank 0):")
    for v in verdicts:
        print(f"  {'PASS' if v.passed else 'MISS'}  {v.what:<44} {v.value:7.2f} ({v.limit})")


def report(summary: dict[str, Any], result: dict[str, Any], plan: Plan) -> list[Verdict]:
    verdicts = report_coalescing(summary, result)
    lag = summary["lag"]
    print(f"\n2. Loop lag of a {TICK * 1e3:g} ms ticker, ms (rank 0); batch: ms to issue and")
    print("   await N ops (median)\n")
    print(f"{'size':>7} {'N':>5}  {'mode':<16} {'batch':>8} {'p50':>7} {'p99':>7} {'max':>7} "
          f"{'ticks':>6}")  # fmt: skip
    idle = lag[IDLE]["lag"]
    print(f"{'':>7} {'0':>5}  {IDLE:<16} {'':>8} {ms(idle['median']):>7} {ms(idle['p99']):>7} "
          f"{ms(idle['max']):>7} {idle['count']:>6}")  # fmt: skip
    for size in plan.lag_sizes:
        for count in LAG_COUNTS:
            for mode in LAG_MODES:
                cell = lag[f"{size}/{count}/{mode}"]
                row, batch = cell["lag"], cell["batch"]
                print(
                    f"{format_bytes(size):>7} {count:>5}  {mode:<16} {ms(batch['median']):>8} "
                    f"{ms(row['median']):>7} {ms(row['p99']):>7} {ms(row['max']):>7} "
                    f"{row['count']:>6}"
                )
                if count == max(LAG_COUNTS) and mode.startswith("agang"):
                    p99 = row["p99"]
                    verdicts.append(Verdict(f"{mode} p99 lag, {count} x {format_bytes(size)} "
                                            f"(ms)", p99 * 1e3, f"< {LAG_TARGET * 1e3:g}",
                                            p99 < LAG_TARGET))  # fmt: skip

    checked = summary["lag_checked"]
    print("\n   The agang rows again on a gang that checks order (Gloo's default), lag in ms")
    print(f"\n{'size':>7} {'N':>5}  {'mode':<16} {'off p99':>8} {'on p99':>8} {'off max':>8} "
          f"{'on max':>8}")  # fmt: skip
    for size in plan.lag_sizes:
        for count in LAG_COUNTS:
            for mode in AGANG_LAG_MODES:
                key = f"{size}/{count}/{mode}"
                off, on = lag[key]["lag"], checked[key]
                print(
                    f"{format_bytes(size):>7} {count:>5}  {mode:<16} {ms(off['p99']):>8} "
                    f"{ms(on['p99']):>8} {ms(off['max']):>8} {ms(on['max']):>8}"
                )

    order = summary["order"]
    print("\n3. Order checking: ms (rank 0); phases off/on alternate, each a fresh gang\n")
    print(f"{'op':<18} {'off median':>10} {'on median':>10} {'on/off':>7} {'off p90':>8} "
          f"{'on p90':>8}")  # fmt: skip
    for name, off in order["off"].items():
        on = order["on"][name]
        print(
            f"{name:<18} {ms(off['median']):>10} {ms(on['median']):>10} "
            f"{on['median'] / off['median']:>6.2f}x {ms(off['p90']):>8} {ms(on['p90']):>8}"
        )

    print_verdicts(verdicts)
    return verdicts


# Command line.


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="short smoke-test run")
    sizes.add_argument(
        "--smoke", action="store_true", help="every part once, tiny: every output, no meaning"
    )
    _common.add_out_argument(parser)
    parser.add_argument(
        "--coalescing-only",
        type=int,
        metavar="ROUNDS",
        help="run part 1 alone, ROUNDS rounds; print its table, write nothing",
    )
    args = parser.parse_args(argv)
    plan = SMOKE_PLAN if args.smoke else PLANS[args.quick]
    if args.coalescing_only is not None:
        plan = replace(plan, coalesce_rounds=args.coalescing_only, coalescing_only=True)
    load = os.getloadavg()[0]
    print(f"2 Gloo ranks on 127.0.0.1, torch {torch.__version__}, load average {load:.1f} "
          f"on {os.cpu_count()} CPUs; {plan}\n", flush=True)  # fmt: skip
    started = time.monotonic()
    results = run_world(
        functools.partial(_rank_main, plan), _common.WORLD_SIZE, make_gang=False, timeout=900.0
    )
    elapsed = time.monotonic() - started
    summaries = [summarize(result) for result in results]
    if plan.coalescing_only:
        print_verdicts(report_coalescing(summaries[0], results[0]))
        print(f"\nRanks ran {elapsed:.0f} s; load average {os.getloadavg()[0]:.1f} at the end.")
        return 0
    verdicts = report(summaries[0], results[0], plan)
    steps = ", ".join(f"{step} {sec:.0f} s" for step, sec in results[0]["seconds"].items())
    print(f"\nRanks ran {elapsed:.0f} s (rank 0: {steps}; the rest is process start-up); "
          f"load average {os.getloadavg()[0]:.1f} at the end.")  # fmt: skip

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "method": __doc__.split("Usage:")[0].strip() if __doc__ else "",
        "torch": torch.__version__,
        "agang": agang.__version__,
        "quick": args.quick,
        "plan": asdict(plan),
        "lag_counts": LAG_COUNTS,
        "lag_modes": LAG_MODES,
        "lag_target_s": LAG_TARGET,
        "seconds": elapsed,
        "rank_seconds": [result["seconds"] for result in results],
        "load_average": [load, os.getloadavg()[0]],
        "targets": [asdict(v) for v in verdicts],
        "ranks": [
            {
                **summary,
                "ops_per_scope": result["ops_per_scope"],
                "gang_statistics": result["statistics"],
                "coalesce_samples_ms": {
                    name: [round(s * 1e3, 4) for s in values]
                    for name, values in result["coalesce"].items()
                },
            }
            for summary, result in zip(summaries, results, strict=True)
        ],
    }
    source = out / "scheduler.json"
    source.write_text(json.dumps(document, indent=1, default=str))
    written = [source, *plot_scheduler.plot(source, out)]
    print(f"Wrote {', '.join(path.name for path in written)} in {out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
