"""What order checking's call-site mode adds per op, on top of plain order checking.

One process, ``FakeGang`` (no transport: the figures are agang's own CPU cost per op,
issue plus await), a 4-element all-reduce issued and awaited ``--ops`` times per round,
with ``check_order`` off, on and ``"call_site"``, the settings interleaved round by round;
medians over rounds. The call-site mode walks the caller's frames to the first one
outside agang and appends ``file:line`` to the fingerprint.

Usage:
    python bench/bench_order_modes.py            # 15 rounds of 2,000 ops
    python bench/bench_order_modes.py --quick    # 3 rounds of 500 ops
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

import agang

SETTINGS: dict[str, bool | str] = {"off": False, "on": True, "call_site": "call_site"}


async def _round(gang: agang.Gang, ops: int) -> float:
    tensor = torch.ones(4)
    started = time.perf_counter()
    for _ in range(ops):
        await gang.all_reduce(tensor)
    return (time.perf_counter() - started) / ops


async def _measure(rounds: int, ops: int) -> dict[str, list[float]]:
    gangs = {
        name: agang.FakeGang(rank=0, size=2, check_order=value)  # type: ignore[arg-type]
        for name, value in SETTINGS.items()
    }
    samples: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for gang in gangs.values():
        await _round(gang, ops)  # warm-up
    for _ in range(rounds):
        for name, gang in gangs.items():
            samples[name].append(await _round(gang, ops))
    for gang in gangs.values():
        await gang.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="3 rounds of 500 ops")
    parser.add_argument("--ops", type=int, default=2000, help="ops per mode and round")
    parser.add_argument("--rounds", type=int, default=15, help="rounds")
    args = parser.parse_args()
    rounds, ops = (3, 500) if args.quick else (args.rounds, args.ops)
    samples = asyncio.run(_measure(rounds, ops))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"FakeGang, 4-element all_reduce, {rounds} rounds x {ops} ops, median per op")
    print(f"{'check_order':<12} {'us/op':>8} {'vs off':>8}")
    for name, value in medians.items():
        print(f"{name:<12} {value * 1e6:>8.1f} {value / medians['off']:>7.2f}x")
    added = (medians["call_site"] - medians["on"]) * 1e6
    print(f"call_site adds {added:.1f} us per op to plain order checking")


if __name__ == "__main__":
    main()
