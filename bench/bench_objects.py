"""Object collectives: agang's ``broadcast_objects`` / ``all_gather_objects`` against c10d's.

Method:
    2 and then 4 ranks run as real processes on 127.0.0.1 over Gloo; each rank makes its
    gang with ``agang.init_sync``, and c10d's modes use the same default process group.
    The object is a ``bytes`` payload of the given size (broadcast: ``[payload]`` from
    rank 0; all-gather: one payload from every rank), so every format sends about the
    payload's size. Modes:

    - ``c10d``: ``dist.broadcast_object_list`` / ``dist.all_gather_object`` (pickle;
      they need numpy to read what they receive);
    - ``agang pickle``: the agang call with ``serializer="pickle"``, then ``.wait()``;
    - ``agang safe``: the same with the default ``serializer="safe"``.

    For each world size and payload size, R rounds; in each round every mode runs one op
    per collective, in an order rotated each round, after an untimed ``dist.barrier()``.
    Each rank times each op from the call to the decoded result; an op's time is its
    slowest rank's (a broadcast is done when the last receiver has its objects). The
    table gives each mode's median over rounds and its ratio to c10d's median.

    Then, in this process, the two formats alone: the best of 3 encodings and decodings
    of a few shapes of data, so that the cost of the safe format's Python reader on
    containers of many small values is on record.

Usage:
    python bench/bench_objects.py           # 1 KiB, 1 MiB, 100 MiB on 2 and 4 ranks (~5 min)
    python bench/bench_objects.py --quick   # 1 KiB and 1 MiB, fewer rounds (~1 min)
    python bench/bench_objects.py --formats-only
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import format_bytes, format_seconds

import agang
from agang._collective.serialize import decode, encode
from agang.testing import run_world

MODES = ("c10d", "agang pickle", "agang safe")
OPS = ("broadcast", "all_gather")
TARGET = 1.2
# Rounds per payload size (full run, quick run).
ROUNDS = {1 << 10: (30, 10), 1 << 20: (12, 5), 100 << 20: (3, 0)}

Plan = list[tuple[int, int]]  # (payload bytes, rounds)


def _run_op(gang: agang.Gang, mode: str, op: str, payload: bytes) -> Any:
    if op == "broadcast":
        objects: list[Any] = [payload] if gang.rank == 0 else [None]
        if mode == "c10d":
            dist.broadcast_object_list(objects, src=0)
            return objects
        serializer = "pickle" if mode == "agang pickle" else "safe"
        return gang.broadcast_objects(objects, 0, serializer=serializer).wait()
    if mode == "c10d":
        gathered: list[Any] = [None] * gang.size
        dist.all_gather_object(gathered, payload)
        return gathered
    serializer = "pickle" if mode == "agang pickle" else "safe"
    return gang.all_gather_objects(payload, serializer=serializer).wait()


def _measure(gang: agang.Gang, plan: Plan) -> dict[str, list[float]]:
    """Every op's time on this rank, keyed ``"size/op/mode"``, in the same order everywhere."""
    samples: dict[str, list[float]] = {}
    for num_bytes, rounds in plan:
        payload = bytes([gang.rank]) * num_bytes
        for index in range(rounds + 1):  # round 0 warms up, and is dropped
            order = MODES[index % len(MODES) :] + MODES[: index % len(MODES)]
            for mode in order:
                for op in OPS:
                    dist.barrier()
                    started = time.perf_counter()
                    result = _run_op(gang, mode, op, payload)
                    elapsed = time.perf_counter() - started
                    _check(result, op, gang.size, num_bytes)
                    if index:
                        samples.setdefault(f"{num_bytes}/{op}/{mode}", []).append(elapsed)
                    del result
    return samples


def _check(result: Any, op: str, size: int, num_bytes: int) -> None:
    expected = (
        [b"\x00" * num_bytes]
        if op == "broadcast"
        else [bytes([r]) * num_bytes for r in range(size)]
    )
    if result != expected:
        raise AssertionError(f"{op} of {num_bytes} B returned the wrong objects")


def _rank_main(plan: Plan) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    gang = agang.init_sync(in_process=False, timeout=60.0, op_timeout=300.0)
    try:
        return _measure(gang, plan)
    finally:
        gang.close_sync()


def report(world_size: int, plan: Plan, per_rank: list[dict[str, list[float]]]) -> list[float]:
    """Prints one world size's table; returns the agang/c10d ratios."""
    print(f"\n{world_size} ranks: median op time (slowest rank), ratio to c10d")
    print(f"| payload | op | {' | '.join(MODES)} |")
    print("| --- | --- |" + " --- |" * len(MODES))
    ratios = []
    for num_bytes, _ in plan:
        for op in OPS:
            medians = {}
            for mode in MODES:
                key = f"{num_bytes}/{op}/{mode}"
                slowest = [max(times) for times in zip(*(r[key] for r in per_rank), strict=True)]
                medians[mode] = statistics.median(slowest)
            cells = [format_seconds(medians["c10d"])]
            for mode in MODES[1:]:
                ratio = medians[mode] / medians["c10d"]
                ratios.append(ratio)
                cells.append(f"{format_seconds(medians[mode])} ({ratio:.2f}x)")
            print(f"| {format_bytes(num_bytes)} | {op} | {' | '.join(cells)} |")
    return ratios


def _best(fn: Callable[[], Any], repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def formats(quick: bool) -> None:
    """Prints the two formats' encode and decode times for a few shapes of data."""
    scale = 10 if quick else 1
    shapes: dict[str, Any] = {
        f"bytes, {format_bytes((100 << 20) // scale)}": [b"x" * ((100 << 20) // scale)],
        f"{1_000_000 // scale:,} ints in a list": [list(range(1_000_000 // scale))],
        f"dict of {100_000 // scale:,} str -> (int, float, None)": [
            {f"k{i}": (i, float(i), None) for i in range(100_000 // scale)}
        ],
        "a small config dict": [{"lr": 3e-4, "name": "run", "layers": [64, 32], "f": (True,)}],
    }
    print("\nthe formats alone (best of 3): encode / decode")
    print("| data | safe | pickle |")
    print("| --- | --- | --- |")
    for name, obj in shapes.items():
        cells = []
        for serializer in ("safe", "pickle"):
            data = memoryview(b"".join(encode(obj, serializer, name="obj")))
            assert decode(data, serializer, sender="bench") == obj
            write = _best(lambda s=serializer, o=obj: encode(o, s, name="obj"))
            read = _best(lambda s=serializer, d=data: decode(d, s, sender="bench"))
            cells.append(f"{format_seconds(write)} / {format_seconds(read)}")
        print(f"| {name} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="1 KiB and 1 MiB, fewer rounds")
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated")
    parser.add_argument("--formats-only", action="store_true", help="only the formats alone")
    args = parser.parse_args(argv)
    if args.formats_only:
        formats(args.quick)
        return 0
    try:
        import numpy  # noqa: F401  # c10d's object collectives read what they receive with it
    except ImportError:
        print("c10d's object collectives need numpy, which is not installed.", file=sys.stderr)
        return 2
    plan = [(size, rounds[1 if args.quick else 0]) for size, rounds in ROUNDS.items()]
    plan = [(size, rounds) for size, rounds in plan if rounds]
    ratios: list[float] = []
    for world_size in map(int, args.world_sizes.split(",")):
        # One torch thread per rank: the ranks share the machine (OMP_NUM_THREADS keeps
        # agang.init from sizing the pool to a share of the CPUs instead).
        per_rank = run_world(
            functools.partial(_rank_main, plan),
            world_size,
            make_gang=False,
            timeout=900.0,
            env={"OMP_NUM_THREADS": "1"},
        )
        ratios += report(world_size, plan, per_rank)
    formats(args.quick)
    worst = max(ratios)
    verdict = "PASS" if worst <= TARGET else "MISS"
    print(f"\nworst agang/c10d ratio {worst:.2f}x (target <= {TARGET}x): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
