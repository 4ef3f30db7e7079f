"""Where a coalesce() scope's time goes, phase by phase, against flattening by hand.

    python bench/bench_coalesce_phases.py [--rounds N]

Two local Gloo ranks run 64 all-reduces of 4 KiB (as ``bench_scheduler.py`` part 1)
two ways, alternating which goes first each round, after a raw ``dist.barrier()``:
- by hand: ``torch.cat`` | one blocking ``dist.all_reduce`` | copy back per tensor;
- ``agang``: the 64 calls inside the scope | the scope's end (grouping, the copy into
  the flat buffer, issuing the flat op) | ``await`` (the op, the copy back, finishing
  64 handles, waking the loop).
Rank 0's medians per phase, in microseconds; the first 10% of rounds are warm-up. The
two totals' ratio is ``bench_scheduler.py``'s "coalesce / hand-flattened"; the phases
show which part is agang's own Python (the calls and the scope's end, against the hand
path's cat and copy back) and which is the all-reduce both pay.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from _common import WORLD_SIZE

import agang
from agang.testing import run_world

NUMEL = 1024
BATCH = 64
HAND_PHASES = ("cat", "all_reduce", "copy back")
AGANG_PHASES = ("64 calls", "scope end", "await")


async def measure(rounds: int, gang: agang.Gang) -> dict[str, list[list[float]]]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the two ranks share the machine
    tensors = [torch.ones(NUMEL) for _ in range(BATCH)]
    samples: dict[str, list[list[float]]] = {"hand": [], "agang": []}

    def by_hand() -> list[float]:
        t0 = time.perf_counter()
        flat = torch.cat(tensors)
        t1 = time.perf_counter()
        dist.all_reduce(flat)
        t2 = time.perf_counter()
        for tensor, part in zip(tensors, torch.split(flat, NUMEL), strict=True):
            tensor.copy_(part)
        return [t1 - t0, t2 - t1, time.perf_counter() - t2]

    async def by_agang() -> list[float]:
        t0 = time.perf_counter()
        with gang.coalesce() as batch:
            for tensor in tensors:
                _ = gang.all_reduce(tensor)
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        await batch
        return [t1 - t0, t2 - t1, time.perf_counter() - t2]

    for number in range(rounds):
        for mode in ("hand", "agang") if number % 2 else ("agang", "hand"):
            dist.barrier()
            samples[mode].append(by_hand() if mode == "hand" else await by_agang())
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=300, help="rounds, the first 10%% warm-up")
    args = parser.parse_args()
    if args.rounds < 10:
        parser.error("--rounds must be at least 10")
    # OMP_NUM_THREADS keeps agang.init from sizing torch's pool (measure sets 1 thread);
    # the op deadline is agang.init's default.
    ranks = run_world(
        functools.partial(measure, args.rounds),
        WORLD_SIZE,
        timeout=600,
        init_timeout=60,
        op_timeout=300.0,
        env={"OMP_NUM_THREADS": "1"},
    )
    samples = ranks[0]
    skip = args.rounds // 10
    totals = {}
    for mode, names in (("hand", HAND_PHASES), ("agang", AGANG_PHASES)):
        rows = samples[mode][skip:]
        medians = [statistics.median(row[i] for row in rows) * 1e6 for i in range(3)]
        totals[mode] = statistics.median(sum(row) for row in rows) * 1e6
        phases = ", ".join(f"{name} {us:.0f} us" for name, us in zip(names, medians, strict=True))
        print(f"{mode:>5}: {phases}; total {totals[mode]:.0f} us (median)")
    print(f"agang / hand: {totals['agang'] / totals['hand']:.2f}x ({len(rows)} rounds each)")


if __name__ == "__main__":
    main()
