"""Latency of one all-reduce: raw c10d calls against ``await gang.all_reduce`` per loop.

Method:
    Two ranks run as real processes on 127.0.0.1 over Gloo. The parent hosts the
    TCPStore, starts the ranks, collects their samples and reports. Each rank makes its
    gang with ``agang.init_sync``; the raw c10d modes use the same default process group.

    Every rank runs the same fixed sequence of ops (collectives must match across ranks)::

        for each message size (a float32 tensor of zeros, so repeated sums stay 0):
            for each of R rounds:
                for each mode, in an order rotated by one each round:
                    one batch: 1 warm-up op, then B ops, each timed on its own

    The warm-up op of each batch is discarded: it absorbs the switch from the previous
    mode and the wait for the other rank to reach the same batch. Interleaving all modes
    in every round makes drift and background load hit them alike; rotating the order
    keeps any after-effect of one mode (garbage, a torn-down loop) off a fixed neighbour.
    The samples of all rounds are pooled per (size, mode); the table reports rank 0's
    median and p90 and each median as a ratio to the raw blocking median at the same size
    (rank 1's numbers are in the JSON file). Absolute times on a busy machine are noisy:
    compare ratios within one run.

    The agang modes run each batch in a fresh ``anyio.run``; only the ops are timed,
    from the call to the end of the ``await``, so loop start-up is not counted. Each
    loop runs twice: with the default ``wait_mode="park"`` and, suffixed ``brief``, with
    ``"block_briefly"`` (``agang._runtime.brief_wait``). ``agang wait()`` blocks a plain thread in
    ``Handle.wait()``: agang's issue and completion with no loop to wake, the least any
    way of waking a loop could cost on top of agang. ``c10d cb+wait`` is raw c10d with a
    no-op Python callback on the Work's future before a blocking wait: what learning of
    completion in Python costs by itself, against ``c10d async+wait``. The table gives
    each median as a ratio to the raw blocking median and to the floor, and the
    difference from the floor in microseconds; targets are checked per loop (4 B: 1.25x
    on asyncio and uvloop, 1.4x on trio; 1.05x from 256 KiB up on all three).

Usage:
    python bench/bench_latency.py                 # full run, about 4 minutes
    python bench/bench_latency.py --quick         # smoke test, about 40 s
    python bench/bench_latency.py --smoke --sizes 4   # 1 round of 2 ops: for tests
    python bench/bench_latency.py --sizes 4,256K  # chosen sizes (bytes; K, M, G suffixes)

Writes ``bench/out/latency.json`` (plan, statistics, per-op samples of both ranks) and
``bench/out/latency.png`` (latency against size, and ratio to the raw blocking call) where
matplotlib is installed; ``--out DIR`` writes them elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import _common
import anyio
import torch
import torch.distributed as dist
from _common import WORLD_SIZE, format_bytes, format_seconds

import agang
from agang._policy import WaitMode
from agang.testing import run_world

WARMUP_OPS = 1
DEFAULT_SIZES = "4,4K,256K,4M,64M"
BASELINE = "c10d blocking"


class Target(NamedTuple):
    """The most an agang mode's median may cost, as a ratio to the raw blocking median."""

    smallest: int  # bytes
    largest: int
    limit: float
    loops: tuple[str, ...]  # the agang modes' loops it applies to

    def covers(self, num_bytes: int, mode: str) -> bool:
        loop = mode.removeprefix("agang ").removesuffix(BRIEF)
        return self.smallest <= num_bytes <= self.largest and loop in self.loops


#: The suffix of the modes that await with ``wait_mode="block_briefly"``.
BRIEF = " brief"
TARGETS = (
    Target(0, 4, 1.25, ("asyncio", "uvloop")),
    Target(0, 4, 1.4, ("trio",)),
    Target(256 * 1024, sys.maxsize, 1.05, ("asyncio", "uvloop", "trio")),
)

# Samples per mode, keyed by mode name; times in seconds.
Samples = dict[str, list[float]]
# Raw c10d completing through a future callback on an asyncio loop: what any
# event-driven design costs here before agang adds anything.
FLOOR = "c10d cb->asyncio"

BatchRunner = Callable[[agang.Gang, torch.Tensor, int], list[float]]


# The modes. Each runs `count` all-reduces of `tensor` and returns their latencies.


def _c10d_blocking(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        dist.all_reduce(tensor)
        samples.append(time.perf_counter() - start)
    return samples


def _c10d_async_wait(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        dist.all_reduce(tensor, async_op=True).wait()
        samples.append(time.perf_counter() - start)
    return samples


def _c10d_callback_and_wait(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    """Raw c10d with a Python callback on its Work's future that does nothing, and a
    blocking ``wait()``: what a Python completion costs in itself on Gloo (c10d's
    thread takes the GIL to run it, as the waiter wakes), whatever the callback does.
    Every design that learns of completion in Python, agang's included, pays it."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        work = dist.all_reduce(tensor, async_op=True)
        work.get_future().add_done_callback(_ignore)
        work.wait()
        samples.append(time.perf_counter() - start)
    return samples


def _ignore(_: object) -> None:
    pass


def _agang_blocking_wait(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    """agang without any loop: ``Handle.wait()`` blocks the thread on a lock that the
    completion releases. What agang's own issue and completion cost, with no wake-up."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        gang.all_reduce(tensor).wait()
        samples.append(time.perf_counter() - start)
    return samples


async def _agang_awaits(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await gang.all_reduce(tensor)
        samples.append(time.perf_counter() - start)
    return samples


async def _c10d_callback_wakes_loop(
    gang: agang.Gang, tensor: torch.Tensor, count: int
) -> list[float]:
    """The floor of any design that neither blocks the loop nor polls: raw c10d, whose
    Work future's callback wakes the loop with ``call_soon_threadsafe``. No agang code."""
    loop = asyncio.get_running_loop()
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        future = loop.create_future()
        work = dist.all_reduce(tensor, async_op=True)
        work.get_future().add_done_callback(
            lambda _, f=future: loop.call_soon_threadsafe(f.set_result, None)
        )
        await future
        samples.append(time.perf_counter() - start)
    return samples


def _raw_on_asyncio(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
    return asyncio.run(_c10d_callback_wakes_loop(gang, tensor, count))


def _set_wait_mode(gang: agang.Gang, wait_mode: WaitMode) -> None:
    # A user picks the mode once, for every gang (``AGANG_WAIT_MODE``); the bench
    # switches the one gang's between batches, so that both modes share every round.
    gang._engine.policy = dataclasses.replace(gang.policy, wait_mode=wait_mode)  # type: ignore[attr-defined]


def _on_loop(backend: str, options: dict[str, Any], wait_mode: WaitMode) -> BatchRunner:
    def run(gang: agang.Gang, tensor: torch.Tensor, count: int) -> list[float]:
        _set_wait_mode(gang, wait_mode)
        return anyio.run(
            _agang_awaits, gang, tensor, count, backend=backend, backend_options=options
        )

    return run


LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {"use_uvloop": False}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}

MODES: dict[str, BatchRunner] = {
    BASELINE: _c10d_blocking,
    "c10d async+wait": _c10d_async_wait,
    "c10d cb+wait": _c10d_callback_and_wait,
    FLOOR: _raw_on_asyncio,
    "agang wait()": _agang_blocking_wait,
}
for _loop, (_backend, _options) in LOOPS.items():
    MODES[f"agang {_loop}"] = _on_loop(_backend, _options, "park")
    MODES[f"agang {_loop}{BRIEF}"] = _on_loop(_backend, _options, "block_briefly")


# The plan: how many rounds and ops per size. Both ranks get the same one.


@dataclass(frozen=True)
class SizePlan:
    num_bytes: int
    rounds: int
    batch: int  # timed ops per mode and round, after the warm-up op

    def estimated_seconds(self) -> float:
        ops = self.rounds * len(MODES) * (self.batch + WARMUP_OPS)
        return ops * _estimated_op_seconds(self.num_bytes)


def _estimated_op_seconds(num_bytes: int) -> float:
    # Gloo on loopback here: ~0.2 ms at small sizes, ~60 ms at 64 MiB.
    return 2e-4 + num_bytes / 1.1e9


def make_plan(sizes: list[int], *, quick: bool, smoke: bool = False) -> list[SizePlan]:
    """Fixed counts per size: about `budget` seconds of ops per size, split in rounds;
    ``smoke``: one round of 2 ops per mode (every output, no meaning)."""
    if smoke:
        return [SizePlan(num_bytes, 1, 2) for num_bytes in sizes]
    budget, rounds, max_batch = (3.0, 4, 100) if quick else (24.0, 20, 300)
    plans = []
    for num_bytes in sizes:
        per_batch = budget / (rounds * len(MODES) * _estimated_op_seconds(num_bytes))
        batch = min(max_batch, max(1, round(per_batch) - WARMUP_OPS))
        plans.append(SizePlan(num_bytes, rounds, batch))
    return plans


# One rank.


def _measure_size(gang: agang.Gang, plan: SizePlan) -> Samples:
    tensor = torch.zeros(plan.num_bytes // 4, dtype=torch.float32)
    names = list(MODES)
    samples: Samples = {name: [] for name in names}
    for round_index in range(plan.rounds):
        # Rotate the order each round, so no mode always follows the same other one.
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            samples[name] += MODES[name](gang, tensor, WARMUP_OPS + plan.batch)[WARMUP_OPS:]
    return samples


def _rank_main(plans: list[SizePlan]) -> dict[int, Samples]:
    """A rank's process: makes its gang (sync, as the sync modes need) and runs the plan."""
    gang = agang.init_sync(in_process=False, timeout=60.0, op_timeout=120.0)
    try:
        return {plan.num_bytes: _measure_size(gang, plan) for plan in plans}
    finally:
        gang.close_sync()


# The parent: starts the ranks and collects their samples.


def run_ranks(plans: list[SizePlan], timeout: float) -> list[dict[int, Samples]]:
    """Runs the plan on WORLD_SIZE local ranks; returns each rank's samples."""
    return run_world(
        functools.partial(_rank_main, plans), WORLD_SIZE, make_gang=False, timeout=timeout
    )


# Reporting.


@dataclass(frozen=True)
class Stats:
    num_bytes: int
    mode: str
    rank: int
    count: int
    median: float
    p90: float
    p99: float
    ratio: float  # median over the raw blocking median at the same size and rank
    over_floor: float  # median over the raw callback-to-loop median (FLOOR)
    above_floor: float  # median minus that median, in seconds


def summarize(rank: int, by_size: dict[int, Samples]) -> list[Stats]:
    rows = []
    for num_bytes, samples in by_size.items():
        baseline = statistics.median(samples[BASELINE])
        floor = statistics.median(samples[FLOOR])
        for mode, values in samples.items():
            cuts = statistics.quantiles(values, n=100, method="inclusive")
            median = statistics.median(values)
            rows.append(
                Stats(
                    num_bytes=num_bytes,
                    mode=mode,
                    rank=rank,
                    count=len(values),
                    median=median,
                    p90=cuts[89],
                    p99=cuts[98],
                    ratio=median / baseline,
                    over_floor=median / floor,
                    above_floor=median - floor,
                )
            )
    return rows


def print_table(rows: list[Stats]) -> None:
    header = (
        f"{'size':>8}  {'mode':<20} {'ops':>6} {'median':>10} {'p90':>10} {'ratio':>7}"
        f" {'vs floor':>9} {'above floor':>12}"
    )
    print(header)
    print("-" * len(header))
    previous = None
    for row in rows:
        size = format_bytes(row.num_bytes) if row.num_bytes != previous else ""
        previous = row.num_bytes
        print(
            f"{size:>8}  {row.mode:<20} {row.count:>6} {format_seconds(row.median):>10} "
            f"{format_seconds(row.p90):>10} {row.ratio:>6.2f}x {row.over_floor:>8.2f}x "
            f"{row.above_floor * 1e6:>9.0f} us"
        )


@dataclass(frozen=True)
class Verdict:
    num_bytes: int
    mode: str
    ratio: float
    limit: float
    passed: bool


def check_targets(rows: list[Stats]) -> list[Verdict]:
    """One verdict per agang mode and size that a target covers."""
    return [
        Verdict(row.num_bytes, row.mode, row.ratio, target.limit, row.ratio <= target.limit)
        for row in rows
        if row.mode.startswith("agang") and row.mode != "agang wait()"
        for target in TARGETS
        if target.covers(row.num_bytes, row.mode)
    ]


def print_targets(verdicts: list[Verdict]) -> None:
    print("\nTargets (median ratio to raw blocking, rank 0):")
    for v in verdicts:
        print(
            f"  {'PASS' if v.passed else 'MISS'}  {format_bytes(v.num_bytes):>8}  "
            f"{v.mode:<20} {v.ratio:.2f}x (limit {v.limit:.2f}x)"
        )


def write_json(
    path: Path,
    plans: list[SizePlan],
    rows: list[Stats],
    verdicts: list[Verdict],
    results: list[dict[int, Samples]],
    quick: bool,
) -> None:
    document = {
        "method": __doc__.split("Usage:")[0].strip() if __doc__ else "",
        "torch": torch.__version__,
        "agang": agang.__version__,
        "backend": "gloo",
        "world_size": WORLD_SIZE,
        "quick": quick,
        "warmup_ops_per_batch": WARMUP_OPS,
        "plan": [asdict(plan) for plan in plans],
        "stats": [asdict(row) for row in rows],
        "targets": [asdict(verdict) for verdict in verdicts],
        "samples_us": [
            {
                str(size): {
                    mode: [round(s * 1e6, 2) for s in values] for mode, values in samples.items()
                }
                for size, samples in by_size.items()
            }
            for by_size in results
        ],
    }
    path.write_text(json.dumps(document, indent=1))


def write_plot(plt: Any, path: Path, rows: list[Stats]) -> None:
    """Left: median latency (bar up to p90) against size. Right: median ratio. ``plt``
    is matplotlib's pyplot (see ``_common.write_plots``)."""
    figure, (latency, ratio) = plt.subplots(1, 2, figsize=(12, 5))
    for index, mode in enumerate(MODES):
        mine = [row for row in rows if row.mode == mode]
        # Nudge each mode sideways a little so the p90 bars do not hide each other.
        sizes = [row.num_bytes * 1.08**index for row in mine]
        medians = [row.median * 1e3 for row in mine]
        above = [(row.p90 - row.median) * 1e3 for row in mine]
        latency.errorbar(
            sizes, medians, yerr=[[0.0] * len(mine), above], marker="o", capsize=3, label=mode
        )
        ratio.plot(sizes, [row.ratio for row in mine], marker="o", label=mode)
    latency.set(
        xscale="log",
        yscale="log",
        xlabel="message size",
        ylabel="latency (ms): median, bar to p90",
        title="all_reduce, 2 Gloo ranks on loopback (rank 0)",
    )
    ratio.set(
        xscale="log",
        xlabel="message size",
        ylabel="median / raw blocking median",
        title="Cost relative to raw blocking (dotted: targets)",
    )
    for target in TARGETS:
        ratio.axhline(target.limit, color="grey", linestyle=":", linewidth=1)
    measured = sorted({row.num_bytes for row in rows})
    for axes in (latency, ratio):
        axes.set_xticks(measured, [format_bytes(size) for size in measured])
        axes.minorticks_off()
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# Command line.


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4, 4K, 256KiB, 64M)")
    num_bytes = int(match[1]) * 1024 ** " KMG".index((match[2] or " ").upper())
    if num_bytes < 4 or num_bytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: size must be a positive multiple of 4 B")
    return num_bytes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help="short smoke-test run (~25 s)")
    modes.add_argument(
        "--smoke", action="store_true", help="1 round of 2 ops: every output, no meaning"
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="comma-separated message sizes in bytes, K/M/G suffixes",
    )
    _common.add_out_argument(parser)
    args = parser.parse_args(argv)
    try:
        args.sizes = sorted({parse_size(text) for text in args.sizes.split(",")})
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = make_plan(args.sizes, quick=args.quick, smoke=args.smoke)
    estimate = sum(plan.estimated_seconds() for plan in plans)
    print(f"2 Gloo ranks on 127.0.0.1, torch {torch.__version__}; plan (ops per mode):")
    for plan in plans:
        print(
            f"  {format_bytes(plan.num_bytes):>8}: {plan.rounds} rounds x "
            f"({WARMUP_OPS} warm-up + {plan.batch} timed)"
        )
    print(f"Estimated op time {estimate:.0f} s, plus start-up.\n", flush=True)

    started = time.monotonic()
    results = run_ranks(plans, timeout=120.0 + 10 * estimate)
    rows = summarize(0, results[0])
    print(f"Measured in {time.monotonic() - started:.0f} s. Rank 0:\n")
    print_table(rows)
    verdicts = check_targets(rows)
    print_targets(verdicts)

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    all_rows = rows + summarize(1, results[1])
    write_json(out / "latency.json", plans, all_rows, verdicts, results, args.quick)
    plot = out / "latency.png"
    written = [out / "latency.json"]
    written += _common.write_plots([plot], lambda plt: write_plot(plt, plot, rows))
    print(f"\nWrote {' and '.join(str(path) for path in written)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
