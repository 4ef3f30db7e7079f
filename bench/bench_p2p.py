"""What one small point-to-point op costs: a send from rank 0 to a task awaiting it on
rank 1, agang against raw c10d in the same processes, and where agang's time goes.

The case is a word of the sharded weights' lane (1 KiB by default): rank 1 awaits a
receive; rank 0, once both ranks met and slept (so that both are idle when it comes, as
a push finds them), sends. The latency is from rank 0's call to the moment rank 1's code
goes on, on the machine's one monotonic clock (``time.perf_counter_ns``, which on Linux
is ``CLOCK_MONOTONIC``, the same in every process): rank 0 writes its call's time into
the tensor it sends. Two modes take turns in each round:

- ``c10d``: a raw ``ProcessGroupGloo`` made beside the gang, ``send`` then ``wait()`` on
  rank 0 and ``recv(...).wait()`` on rank 1: no event loop, no agang.
- ``agang``: ``await lane.send(t, 1)`` and ``await lane.recv(t, 0)`` on a lane of the
  gang, on asyncio.

Rank 1 also splits agang's latency at c10d's waiter thread (a wrapper around the
function that thread waits with, ``_common.on_transfers_ended``): ``thread`` is
when c10d's ``wait()`` returned there, ``task`` when the awaiting task went on; the gap
is agang reporting the op and the loop being woken. Rank 0 times its call in both modes:
how long the send takes to return (agang's issue, against c10d's call alone).

    python bench/bench_p2p.py            # 1 KiB, 300 rounds (about 10 s)
    python bench/bench_p2p.py --quick    # 60 rounds

It prints a table and writes ``p2p.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _common import add_out_argument, on_transfers_ended, percentile

from agang import Gang
from agang.testing import run_world

#: The pause before each send: both ranks idle when it comes (seconds).
PAUSE = 0.003
#: Rounds left out of the statistics: they warm the paths up.
WARM = 20


def stamp(tensor: torch.Tensor) -> None:
    """Writes now (ns) into the first 8 bytes of ``tensor``."""
    tensor[:8].view(torch.int64)[0] = time.perf_counter_ns()


def stamped(tensor: torch.Tensor) -> int:
    """The time ``stamp`` wrote into ``tensor``."""
    return int(tensor[:8].view(torch.int64)[0])


async def rank_main(num_bytes: int, rounds: int, gang: Gang) -> dict[str, list[float]]:
    """One rank's rounds; its samples in microseconds, by what was timed."""
    torch.set_num_threads(1)
    rank = gang.rank
    store = dist.distributed_c10d._get_default_store()
    prefixed = dist.PrefixStore("bench_p2p/raw", store)  # type: ignore[attr-defined]
    raw: Any = dist.ProcessGroupGloo(prefixed, rank, gang.size, timedelta(seconds=60))
    seen: list[int] = []
    # Before the lane: its waiter takes the function it waits with when it is made.
    on_transfers_ended(lambda _: seen.append(time.perf_counter_ns()))
    lane = await gang.lane("bench_p2p")
    word = torch.zeros(max(8, num_bytes), dtype=torch.uint8)
    samples: dict[str, list[float]] = {}

    def note(what: str, ns: int) -> None:
        samples.setdefault(what, []).append(ns / 1e3)

    for turn in range(rounds):
        for mode in ("c10d", "agang") if turn % 2 else ("agang", "c10d"):
            raw.barrier(dist.BarrierOptions()).wait()
            if rank == 0:
                await asyncio.sleep(PAUSE)
                if mode == "c10d":
                    stamp(word)
                    called = time.perf_counter_ns()
                    work = raw.send([word], 1, 0)
                    note("c10d: call returned", time.perf_counter_ns() - called)
                    work.wait()
                else:
                    stamp(word)
                    called = time.perf_counter_ns()
                    handle = lane.send(word, 1)
                    note("agang: call returned", time.perf_counter_ns() - called)
                    await handle
            elif mode == "c10d":
                raw.recv([word], 0, 0).wait()
                note("c10d: code goes on", time.perf_counter_ns() - stamped(word))
            else:
                seen.clear()
                await lane.recv(word, 0)
                now = time.perf_counter_ns()
                sent = stamped(word)
                note("agang: c10d's thread has it", seen[-1] - sent)
                note("agang: task goes on", now - sent)
    return {what: values[WARM:] for what, values in samples.items()}


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        what: {"median_us": statistics.median(v), "p90_us": percentile(v, 90), "count": len(v)}
        for what, v in samples.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--bytes", type=int, default=1024, help="the tensor's size in bytes")
    parser.add_argument("--rounds", type=int, default=300, help="rounds of both modes")
    parser.add_argument("--quick", action="store_true", help="60 rounds")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.bytes < 8:
        parser.error("--bytes must be at least 8 (the send's time rides in it)")
    rounds = 60 if args.quick else args.rounds
    if rounds <= WARM:
        parser.error(f"--rounds must be above {WARM} (the warm-up rounds left out)")
    ranks = run_world(functools.partial(rank_main, args.bytes, rounds), 2, timeout=600)
    zero, one = summarize(ranks[0]), summarize(ranks[1])
    print(
        f"A {args.bytes} B send from rank 0 to a task awaiting it on rank 1, "
        f"{rounds - WARM} rounds of each mode (medians and p90, us):"
    )
    for what, stats in [*one.items(), *zero.items()]:
        print(f"  {what:<30} {stats['median_us']:>9.0f} {stats['p90_us']:>9.0f}")
    latency = one["agang: task goes on"]["median_us"] / one["c10d: code goes on"]["median_us"]
    call = zero["agang: call returned"]["median_us"] / zero["c10d: call returned"]["median_us"]
    print(f"agang / c10d: latency {latency:.2f}x, the send's call {call:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "p2p.json").write_text(
        json.dumps({"bytes": args.bytes, "rounds": rounds, "rank0": zero, "rank1": one}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
