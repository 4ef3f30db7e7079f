"""agang's CPU cost per op on its NCCL code path, measured on the simulated NCCL.

    python bench/bench_nccl_sim.py [--ops N] [--rounds R]

No GPU needed: ``agang.testing.SimulatedNccl`` runs agang's real NCCL completion path
(polled on the loop, parked on the gang's watcher thread, the error check) against two
simulated ranks in this process, whose device runs a kernel as soon as it can, on the
thread that made it runnable (no thread hop a GPU would not make). Each op is a
4-element all-reduce issued on both ranks. Three modes, interleaved round by round,
``N`` ops per mode and round:
- raw: the process group's own ``allreduce`` with options made per call (as
  ``dist.all_reduce`` makes them) + ``Work.wait()`` + a device synchronize, what a
  blocking c10d caller pays on the same simulated device;
- agang: ``await gang.all_reduce(t)`` on both ranks (done = finished on the device);
- agang stream-ordered: the same with ``stream_ordered=True`` (done = ordered).
Prints the median microseconds per op over the rounds, the ratio to raw, and agang's
thread hand-offs per awaited op (``agang._runtime.handoffs``: a thread woken to wait for
an op, or a loop woken from another thread). The simulated device's own time is in
every mode; on a GPU a kernel's time takes its place, so agang's CPU cost per op there
is about (ratio - 1) x raw's time here.

Then, unless ``--no-parts``, agang's own Python on the NCCL path, by part, on an
*instant device*: one rank's process group answers every all-reduce with a Work that
has already ended, so nothing but agang's code is timed: the whole ``await
gang.all_reduce(t)``; the issue alone; the poll that learns of the end (reporting it
and finishing the handle); the ``await`` of a handle already finished; and one pass of
the loop (``asyncio.sleep(0)``), for scale. Last, the raw pair of calls and two
instant-device awaits, each alone and then in one loop without touching each other: on
the 2-core machine the two together cost far more than apart, a cost of running two code
paths in turn that agang's ratio on the simulation includes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import agang
from agang._runtime import handoffs
from agang.testing import SimulatedNccl


async def _agang(
    gangs: list[agang.ProcessGroupGang],
    tensors: list[torch.Tensor],
    ops: int,
    handed_off: list[float],
) -> float:
    before = handoffs.num_handoffs()
    started = time.perf_counter()
    for _ in range(ops):
        handles = [gang.all_reduce(t) for gang, t in zip(gangs, tensors, strict=True)]
        for handle in handles:
            await handle
    seconds = (time.perf_counter() - started) / ops
    handed_off.append((handoffs.num_handoffs() - before) / (ops * len(gangs)))
    return seconds


def _raw(sim: SimulatedNccl, groups: list[Any], tensors: list[torch.Tensor], ops: int) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        works = []
        for group, t in zip(groups, tensors, strict=True):
            # What ``dist.all_reduce(t, async_op=True)`` does: options made per call.
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            works.append(group.allreduce([t], options))
        for work in works:
            work.wait()
        for rank in range(len(groups)):
            sim.synchronize(rank)
    return (time.perf_counter() - started) / ops


async def main(ops: int, rounds: int) -> None:
    with SimulatedNccl(2) as sim:
        default = sim.gangs("default")
        ordered = sim.gangs("ordered", stream_ordered=True)
        raw_groups = [gang.process_group for gang in sim.gangs("raw")]
        tensors = [torch.zeros(4) for _ in range(2)]
        samples: dict[str, list[float]] = {"raw": [], "agang": [], "agang stream-ordered": []}
        handed_off: dict[str, list[float]] = {"raw": [0.0], "agang": [], "agang stream-ordered": []}
        for _ in range(rounds + 1):  # the first round warms up
            samples["raw"].append(_raw(sim, raw_groups, tensors, ops))
            samples["agang"].append(await _agang(default, tensors, ops, handed_off["agang"]))
            samples["agang stream-ordered"].append(
                await _agang(ordered, tensors, ops, handed_off["agang stream-ordered"])
            )
        for gang in [*default, *ordered]:
            await gang.close()
    raw = statistics.median(samples["raw"][1:])
    header = f"SimulatedNccl, 2 ranks in one process, torch {torch.__version__}"
    print(f"{header}; {ops} ops x {rounds} rounds")
    print(f"{'mode':<22} {'us per op':>10} {'ratio':>7} {'hand-offs per op':>17}")
    for mode, values in samples.items():
        median = statistics.median(values[1:])
        per_op = statistics.mean(handed_off[mode][-rounds:])
        print(f"{mode:<22} {1e6 * median:>10.1f} {median / raw:>6.2f}x {per_op:>17.2f}")


class _Ended:
    """A Work that has already ended, successfully: the instant device's."""

    __slots__ = ()

    def is_completed(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def wait(self, timeout: object = None) -> bool:
        return True


async def parts(ops: int, rounds: int) -> None:
    """agang's own cost per awaited op on the NCCL path, by part (the module's doc)."""
    ended = _Ended()
    with SimulatedNccl(2) as sim:
        gang = sim.gangs("parts")[0]
        group: Any = gang.process_group
        group.allreduce = lambda tensors, options=None: ended
        group.get_error = lambda: "SUCCESS"
        tensor = torch.zeros(4)
        backend: Any = gang._backend  # type: ignore[attr-defined]
        timed: dict[str, list[float]] = {
            "await all_reduce": [],
            "issue": [],
            "poll that learns the end": [],
            "await of a finished handle": [],
            "loop pass": [],
        }
        clock = time.perf_counter
        for _ in range(rounds + 1):  # the first round warms up
            started = clock()
            for _ in range(ops):
                await gang.all_reduce(tensor)
            timed["await all_reduce"].append((clock() - started) / ops)
            issue = poll = wait = 0.0
            for _ in range(ops):
                a = clock()
                handle = gang.all_reduce(tensor)
                b = clock()
                backend.poll()
                c = clock()
                await handle
                d = clock()
                issue, poll, wait = issue + b - a, poll + c - b, wait + d - c
            timed["issue"].append(issue / ops)
            timed["poll that learns the end"].append(poll / ops)
            timed["await of a finished handle"].append(wait / ops)
            started = clock()
            for _ in range(ops):
                await asyncio.sleep(0)
            timed["loop pass"].append((clock() - started) / ops)
        await gang.close()
    print(f"\nagang's own Python per awaited op, instant device (medians over {rounds} rounds)")
    print(f"{'part':<28} {'us per op':>10}")
    for part, values in timed.items():
        print(f"{part:<28} {1e6 * statistics.median(values[1:]):>10.2f}")


async def side_by_side(ops: int, rounds: int) -> None:
    """The raw pair of calls alone, two instant-device awaits alone, and both in one loop
    without touching each other: what interleaving two code paths costs this machine."""
    ended = _Ended()
    with SimulatedNccl(2) as sim:
        instant = sim.gangs("instant")
        for gang in instant:
            group: Any = gang.process_group
            group.allreduce = lambda tensors, options=None: ended
            group.get_error = lambda: "SUCCESS"
        raw_groups = [gang.process_group for gang in sim.gangs("raw")]
        tensors = [torch.zeros(4) for _ in range(2)]
        clock = time.perf_counter
        timed: dict[str, list[float]] = {"raw": [], "instant": [], "interleaved": []}
        for _ in range(rounds + 1):  # the first round warms up
            timed["raw"].append(_raw(sim, raw_groups, tensors, ops))
            started = clock()
            for _ in range(ops):
                for gang, tensor in zip(instant, tensors, strict=True):
                    await gang.all_reduce(tensor)
            timed["instant"].append((clock() - started) / ops)
            started = clock()
            for _ in range(ops):
                _raw(sim, raw_groups, tensors, 1)
                for gang, tensor in zip(instant, tensors, strict=True):
                    await gang.all_reduce(tensor)
            timed["interleaved"].append((clock() - started) / ops)
        for gang in instant:
            await gang.close()
    raw, alone, both = (1e6 * statistics.median(timed[k][1:]) for k in timed)
    print(
        f"\nInterleaving, us per op (both ranks, medians over {rounds} rounds): raw {raw:.1f}"
        f" + two instant-device awaits {alone:.1f} = {raw + alone:.1f} apart; {both:.1f}"
        f" in one loop ({both / (raw + alone):.2f}x), though neither touches the other"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ops", type=int, default=200, help="ops per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--no-parts", action="store_true", help="skip the instant-device parts")
    args = parser.parse_args()
    asyncio.run(main(args.ops, args.rounds))
    if not args.no_parts:
        asyncio.run(parts(20 * args.ops, args.rounds))
        asyncio.run(side_by_side(5 * args.ops, args.rounds))
