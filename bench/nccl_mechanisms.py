"""The mechanisms of agang's NCCL completion path, each timed alone on one GPU.

    python bench/nccl_mechanisms.py [--ops N] [--json FILE]

``bench_nccl.py`` times agang's awaited op against raw c10d; this says where an op's
cost goes, mechanism by mechanism, as agang's NCCL road runs them
(``agang._backends.c10d.completion`` rule 3), on a world of one rank over real NCCL. Per
mechanism, the median and p90 microseconds per op of a 4-byte all-reduce, every op timed
alone, the mechanisms interleaved op by op so that drift meets them alike, and each
median as a multiple of the raw baseline:

- ``raw``: ``dist.all_reduce(t)`` then a synchronize of the current stream (the
  baseline ``bench_nccl.py`` uses);
- ``issue``: the c10d call alone (``group.allreduce``), what agang's issue pays;
- ``poll``: the call, then ``Work.is_completed()`` until true, on this thread (rule 3b);
- ``park``: the call, then a watcher thread that waits on the gang's side stream and a
  blocking-sync event and wakes this thread (rule 3c), end to end;
- ``ordered``: the call, then ``Work.wait()`` on the current stream (rule 3e) and a
  synchronize;
- ``query``: ``Work.is_completed()`` of an op already finished, alone.

Needs a CUDA GPU: without one it says so, writes the JSON with the reason, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MECHANISMS = ("raw", "issue", "poll", "park", "ordered", "query")


def _watcher(requests: queue.SimpleQueue[Any], side: Any) -> None:
    """Rule 3c's watcher: per op, its side stream waits for it, then a blocking-sync event
    recorded there is synchronized (the driver sleeps, the GIL is released)."""
    event = torch.cuda.Event(blocking=True)
    while True:
        item = requests.get()
        if item is None:
            return
        work, woken = item
        with torch.cuda.stream(side):
            work.wait()
            event.record(side)
        event.synchronize()
        woken.set()


def measure(ops: int) -> dict[str, Any]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    store = dist.HashStore()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    group = dist.group.WORLD
    assert group is not None
    tensor = torch.ones(1, device="cuda")
    side = torch.cuda.Stream()
    requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
    watcher = threading.Thread(target=_watcher, args=(requests, side), daemon=True)
    watcher.start()
    done = group.allreduce([tensor])
    torch.cuda.synchronize()

    def raw() -> None:
        dist.all_reduce(tensor)
        torch.cuda.current_stream().synchronize()

    def issue() -> None:
        group.allreduce([tensor])

    def poll() -> None:
        work = group.allreduce([tensor])
        while not work.is_completed():
            pass

    def park() -> None:
        woken = threading.Event()
        requests.put((group.allreduce([tensor]), woken))
        woken.wait()

    def ordered() -> None:
        group.allreduce([tensor]).wait()
        torch.cuda.current_stream().synchronize()

    def query() -> None:
        done.is_completed()

    ways: dict[str, Callable[[], None]] = {
        "raw": raw, "issue": issue, "poll": poll, "park": park, "ordered": ordered,
        "query": query,
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in MECHANISMS}
    for _ in range(ops // 10):  # warm-up
        for way in ways.values():
            way()
    torch.cuda.synchronize()
    for _ in range(ops):
        for name, way in ways.items():
            started = time.perf_counter_ns()
            way()
            times[name].append((time.perf_counter_ns() - started) / 1e3)
        torch.cuda.synchronize()  # an issue alone leaves its op queued
    requests.put(None)
    watcher.join(10)
    dist.destroy_process_group()
    baseline = statistics.median(times["raw"])
    return {
        name: {
            "median_us": round(statistics.median(values), 1),
            "p90_us": round(statistics.quantiles(values, n=10)[-1], 1),
            "x_raw": round(statistics.median(values) / baseline, 2),
        }
        for name, values in times.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ops", type=int, default=2000, help="ops per mechanism")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.ops < 10:
        parser.error(f"--ops must be at least 10, but is {args.ops}")
    if not torch.cuda.is_available():
        result: dict[str, Any] = {
            "skipped": "needs a CUDA GPU (torch.cuda.is_available() is False)"
        }
        print(result["skipped"])
    else:
        result = {
            "gpu": torch.cuda.get_device_name(0),
            "ops": args.ops,
            "mechanisms": measure(args.ops),
        }
        print(f"{'mechanism':<10} {'median us':>10} {'p90 us':>10} {'x raw':>8}")
        for name, row in result["mechanisms"].items():
            print(f"{name:<10} {row['median_us']:>10} {row['p90_us']:>10} {row['x_raw']:>8}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
