"""What agang's Python costs per op: ``await gang.all_reduce(t)`` on FakeGang, by stage.

Method:
    One process, no network: ``FakeGang(rank=0, size=2, op_timeout=300.0)`` (the
    deadline ``agang.init`` gives every op; size 2 so that the all-reduce really
    multiplies its tensor in place) and a float32 tensor of one element (zeros, so it
    stays 0). Each stage is a larger piece of the real path than the one before:

    ============  ================================================================
    stage         one op
    ============  ================================================================
    floor         ``t.mul_(2)`` (the in-place op itself), then the loop's one-shot
                  resolved and awaited: an asyncio future (asyncio, uvloop); trio
                  has none, so an Event set and waited (a checkpoint)
    +validation   the gang's tensor check (``Group.tensor``), then the floor
    +backend      the check, then the fake backend's ``start_all_reduce`` (its own
                  Python around the in-place op), then the floor's one-shot
    +issue        ``gang.all_reduce(t)``, not awaited, in place of the in-place op:
                  validation, numbering, busy claim, admission, deadline, start,
                  completion, statistics and the handle; then the floor's one-shot
    await         ``await gang.all_reduce(t)``: the whole op as users write it
    ============  ================================================================

    ``floor+yield`` (asyncio, uvloop) is the floor then ``await asyncio.sleep(0)``: one
    pass of the loop, the least an ``await`` that always yields (a checkpoint, as an
    agang handle's does) can cost; trio's floor yields already.
    ``await broadcast`` is ``await gang.broadcast(t, 0)``: the whole op for a collective
    that takes the general issue path (every collective but ``all_reduce``, whose path is
    inline), against the same floor.
    ``.wait()`` (``gang.all_reduce(t).wait()``) runs on a plain thread (loop "sync"),
    against the in-place op alone. The engine's parts are also timed alone, calling
    the real internal functions (``parts``): what each step of issuing costs.

    R rounds; in each round every loop runs once (a fresh loop), and in it every stage
    runs one batch of B ops, in an order rotated each round, after one untimed batch
    that warms the loop. A batch is timed as a whole with ``perf_counter_ns`` and
    divided by B (a timer around each op would cost as much as what it measures). The
    table gives the median over rounds of each stage's cost per op, and its cost above
    the floor of the same loop; the target is at most 6 us above the floor for the
    whole op on asyncio and uvloop. Compare within one run: other load on the machine
    moves every figure.

Usage:
    python bench/bench_overhead.py              # 40 rounds x 500 ops, about 30 s
    python bench/bench_overhead.py --rounds 10  # quicker
    python bench/bench_overhead.py --profile 20000   # also a cProfile of 20000 ops
    python bench/bench_overhead.py --smoke      # 1 round of 2 ops: every output, for tests

Writes ``bench/out/overhead.json`` (plan, medians, per-round figures, verdicts) and, where
matplotlib is installed, ``bench/out/overhead.png``; ``--out DIR`` writes them elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _common
import torch
import trio
import uvloop

import agang

TARGET_US = 6.0  # the whole op, at most this much above the floor (asyncio, uvloop)
TARGET_LOOPS = ("asyncio", "uvloop")
STAGES = ("floor", "+validation", "+backend", "+issue", "await")
# Not a step of the path: the floor plus one pass of the loop, what any await that
# always yields (a checkpoint, as agang's does) costs at least.
YIELD = "floor+yield"
LOOPS = ("asyncio", "uvloop", "trio")
# Not a step of the path either: the whole op for a collective on the general issue path.
BROADCAST = "await broadcast"

# A stage: given the gang, the tensor and a count, runs that many ops and returns the
# nanoseconds they took together.
Stage = Callable[[agang.FakeGang, torch.Tensor, int], Awaitable[int]]


def make_gang() -> agang.FakeGang:
    return agang.FakeGang(rank=0, size=2, op_timeout=300.0)


# The stages on asyncio (and uvloop): an asyncio future is the floor's one-shot.


async def _floor_asyncio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    loop = asyncio.get_running_loop()
    start = time.perf_counter_ns()
    for _ in range(count):
        tensor.mul_(2)
        future = loop.create_future()
        future.set_result(None)
        await future
    return time.perf_counter_ns() - start


async def _validation_asyncio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    loop = asyncio.get_running_loop()
    check = gang._group.tensor
    start = time.perf_counter_ns()
    for _ in range(count):
        check(tensor, "tensor")
        tensor.mul_(2)
        future = loop.create_future()
        future.set_result(None)
        await future
    return time.perf_counter_ns() - start


async def _backend_asyncio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    loop = asyncio.get_running_loop()
    check, start_all_reduce = gang._group.tensor, gang._backend.start_all_reduce
    start = time.perf_counter_ns()
    for _ in range(count):
        check(tensor, "tensor")
        start_all_reduce(tensor, _SUM, _ignore)
        future = loop.create_future()
        future.set_result(None)
        await future
    return time.perf_counter_ns() - start


async def _yield_asyncio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    loop = asyncio.get_running_loop()
    start = time.perf_counter_ns()
    for _ in range(count):
        tensor.mul_(2)
        future = loop.create_future()
        future.set_result(None)
        await future
        await asyncio.sleep(0)
    return time.perf_counter_ns() - start


async def _issue_asyncio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    loop = asyncio.get_running_loop()
    start = time.perf_counter_ns()
    for _ in range(count):
        gang.all_reduce(tensor)  # finished already: FakeGang's ops end inside the call
        future = loop.create_future()
        future.set_result(None)
        await future
    return time.perf_counter_ns() - start


async def _await(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        await gang.all_reduce(tensor)
    return time.perf_counter_ns() - start


async def _await_broadcast(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        await gang.broadcast(tensor, 0)
    return time.perf_counter_ns() - start


# The same on trio, whose one-shot is an Event.


async def _floor_trio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        tensor.mul_(2)
        event = trio.Event()
        event.set()
        await event.wait()
    return time.perf_counter_ns() - start


async def _validation_trio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    check = gang._group.tensor
    start = time.perf_counter_ns()
    for _ in range(count):
        check(tensor, "tensor")
        tensor.mul_(2)
        event = trio.Event()
        event.set()
        await event.wait()
    return time.perf_counter_ns() - start


async def _backend_trio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    check, start_all_reduce = gang._group.tensor, gang._backend.start_all_reduce
    start = time.perf_counter_ns()
    for _ in range(count):
        check(tensor, "tensor")
        start_all_reduce(tensor, _SUM, _ignore)
        event = trio.Event()
        event.set()
        await event.wait()
    return time.perf_counter_ns() - start


async def _issue_trio(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        gang.all_reduce(tensor)  # finished already: FakeGang's ops end inside the call
        event = trio.Event()
        event.set()
        await event.wait()
    return time.perf_counter_ns() - start


def _ignore(error: BaseException | None) -> None:
    """The ``done`` of a backend op started without the engine."""


_SUM = agang.ReduceOp.SUM
ASYNCIO_STAGES: dict[str, Stage] = {
    **dict(
        zip(
            STAGES,
            (_floor_asyncio, _validation_asyncio, _backend_asyncio, _issue_asyncio, _await),
            strict=True,
        )
    ),
    YIELD: _yield_asyncio,
    BROADCAST: _await_broadcast,
}
TRIO_STAGES: dict[str, Stage] = {
    **dict(
        zip(
            STAGES,
            (_floor_trio, _validation_trio, _backend_trio, _issue_trio, _await),
            strict=True,
        )
    ),
    BROADCAST: _await_broadcast,
}


# A plain thread: .wait() against the in-place op alone.


def _sync_floor(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        tensor.mul_(2)
    return time.perf_counter_ns() - start


def _sync_wait(gang: agang.FakeGang, tensor: torch.Tensor, count: int) -> int:
    start = time.perf_counter_ns()
    for _ in range(count):
        gang.all_reduce(tensor).wait()
    return time.perf_counter_ns() - start


SYNC_STAGES = {"floor": _sync_floor, ".wait()": _sync_wait}


# One round.

# Per-op nanoseconds: loop -> stage -> one figure per round.
Figures = dict[str, dict[str, list[float]]]


def _rotated(names: list[str], index: int) -> list[str]:
    start = index % len(names)
    return names[start:] + names[:start]


async def _one_loop(
    stages: dict[str, Stage], gang: agang.FakeGang, tensor: torch.Tensor, batch: int, index: int
) -> dict[str, float]:
    for stage in stages.values():  # warm-up, untimed
        await stage(gang, tensor, batch)
    return {
        name: await stages[name](gang, tensor, batch) / batch
        for name in _rotated(list(stages), index)
    }


def _run_loop(loop: str, gang: agang.FakeGang, tensor: torch.Tensor, batch: int, index: int) -> Any:
    if loop == "trio":
        return trio.run(_one_loop, TRIO_STAGES, gang, tensor, batch, index)
    main = _one_loop(ASYNCIO_STAGES, gang, tensor, batch, index)
    return uvloop.run(main) if loop == "uvloop" else asyncio.run(main)


def _run_sync(gang: agang.FakeGang, tensor: torch.Tensor, batch: int, index: int) -> Any:
    for stage in SYNC_STAGES.values():
        stage(gang, tensor, batch)
    return {
        name: SYNC_STAGES[name](gang, tensor, batch) / batch
        for name in _rotated(list(SYNC_STAGES), index)
    }


def measure(rounds: int, batch: int) -> Figures:
    gang = make_gang()
    tensor = torch.zeros(1)
    loops = [*LOOPS, "sync"]
    figures: Figures = {loop: {} for loop in loops}
    for index in range(rounds):
        for loop in _rotated(loops, index):
            if loop == "sync":
                result = _run_sync(gang, tensor, batch, index)
            else:
                result = _run_loop(loop, gang, tensor, batch, index)
            for name, nanoseconds in result.items():
                figures[loop].setdefault(name, []).append(nanoseconds)
    gang.close_sync()
    return figures


# Reporting.


@dataclass(frozen=True)
class Row:
    loop: str
    stage: str
    median_us: float
    p10_us: float
    p90_us: float
    above_floor_us: float
    step_us: float  # above the stage before it


def summarize(figures: Figures) -> list[Row]:
    rows = []
    for loop, stages in figures.items():
        medians = {name: statistics.median(values) / 1000 for name, values in stages.items()}
        floor = medians["floor"]
        previous = floor
        order = [name for name in (*STAGES, ".wait()", YIELD, BROADCAST) if name in stages]
        for name in order:
            values = stages[name]
            median = medians[name]
            rows.append(
                Row(
                    loop=loop,
                    stage=name,
                    median_us=median,
                    p10_us=_common.percentile(values, 10) / 1000,
                    p90_us=_common.percentile(values, 90) / 1000,
                    above_floor_us=median - floor,
                    step_us=median - (floor if name in (YIELD, BROADCAST) else previous),
                )
            )
            if name not in (YIELD, BROADCAST):
                previous = median
    return rows


def print_table(rows: list[Row]) -> None:
    print("| loop | stage | median us/op | p10-p90 | above floor | step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row.loop} | {row.stage} | {row.median_us:.2f} | {row.p10_us:.2f}-"
            f"{row.p90_us:.2f} | {row.above_floor_us:+.2f} | {row.step_us:+.2f} |"
        )


@dataclass(frozen=True)
class Verdict:
    loop: str
    above_floor_us: float
    limit_us: float
    passed: bool


def check_targets(rows: list[Row]) -> list[Verdict]:
    return [
        Verdict(row.loop, row.above_floor_us, TARGET_US, row.above_floor_us <= TARGET_US)
        for row in rows
        if row.stage == "await" and row.loop in TARGET_LOOPS
    ]


def print_targets(verdicts: list[Verdict]) -> None:
    print(f"\nTarget: await gang.all_reduce(t) at most {TARGET_US:g} us above the floor:")
    for v in verdicts:
        print(
            f"  {'PASS' if v.passed else 'MISS'}  {v.loop:<8} {v.above_floor_us:+.2f} us "
            f"(limit {v.limit_us:g} us)"
        )


def profile(num_ops: int, top: int = 25) -> str:
    """The top functions (own time) of a cProfile run of ``num_ops`` awaited ops."""
    gang = make_gang()
    tensor = torch.zeros(1)
    asyncio.run(_await(gang, tensor, 1000))  # warm
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(_await(gang, tensor, num_ops))
    profiler.disable()
    gang.close_sync()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    return text.getvalue()


def write_plot(plt: Any, path: Path, rows: list[Row]) -> None:
    """Per loop, each stage's median cost per op, the floor's share shaded."""
    figure, axes = plt.subplots(figsize=(9, 4.5))
    loops = [loop for loop in (*LOOPS, "sync") if any(row.loop == loop for row in rows)]
    width = 0.8 / len(STAGES)
    for index, stage in enumerate((*STAGES, ".wait()")):
        mine = {row.loop: row for row in rows if row.stage == stage}
        if not mine:
            continue
        offset = (min(index, len(STAGES) - 1) - (len(STAGES) - 1) / 2) * width
        positions = [i + offset for i, loop in enumerate(loops) if loop in mine]
        heights = [mine[loop].median_us for loop in loops if loop in mine]
        axes.bar(positions, heights, width, label=stage)
    for i, loop in enumerate(loops):
        floor = next(row.median_us for row in rows if row.loop == loop and row.stage == "floor")
        if loop in TARGET_LOOPS:
            axes.hlines(floor + TARGET_US, i - 0.4, i + 0.4, colors="grey", linestyles=":")
    axes.set_xticks(range(len(loops)), loops)
    axes.set(ylabel="us per op (median over rounds)", title="FakeGang all_reduce, by stage")
    axes.legend()
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds")
    parser.add_argument("--batch", type=int, default=500, help="ops per batch")
    parser.add_argument(
        "--smoke", action="store_true", help="1 round of 2 ops: every output, no meaning"
    )
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="also profile N ops (asyncio)"
    )
    parser.add_argument(
        "--no-parts",
        action="store_true",
        help="skip the engine's parts (they call internals: for an older checkout)",
    )
    _common.add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.batch = 1, 2
        args.profile = args.profile and 10
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"FakeGang(size=2, op_timeout=300), float32[1], torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}; {args.rounds} rounds x {args.batch} ops per "
        f"stage and loop\n",
        flush=True,
    )
    started = time.monotonic()
    figures = measure(args.rounds, args.batch)
    parts: dict[str, list[float]] = {}
    if not args.no_parts:
        import overhead_parts  # it calls internals, which an older checkout may lack

        parts = overhead_parts.measure(args.rounds, args.batch)
    print(f"Measured in {time.monotonic() - started:.0f} s.\n")
    rows = summarize(figures)
    print_table(rows)
    verdicts = check_targets(rows)
    print_targets(verdicts)
    if parts:
        print("\nThe engine's parts alone (real internal calls), median us per op:")
        print("| part | median us/op |\n| --- | --- |")
        for name, values in parts.items():
            print(f"| {name} | {statistics.median(values) / 1000:.2f} |")
    report = profile(args.profile) if args.profile else None
    if report is not None:
        print(f"\ncProfile of {args.profile} awaited ops on asyncio (own time):\n{report}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "method": __doc__.split("Usage:")[0].strip() if __doc__ else "",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "agang": agang.__version__,
        "rounds": args.rounds,
        "batch": args.batch,
        "stats": [asdict(row) for row in rows],
        "targets": [asdict(verdict) for verdict in verdicts],
        "parts_us": {name: statistics.median(values) / 1000 for name, values in parts.items()},
        "per_round_ns": figures,
        "profile": report,
    }
    json_path = out / "overhead.json"
    json_path.write_text(json.dumps(document, indent=1))
    plot = out / "overhead.png"
    written = [json_path]
    written += _common.write_plots([plot], lambda plt: write_plot(plt, plot, rows))
    print(f"\nWrote {' and '.join(str(path) for path in written)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
