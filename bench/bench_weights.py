"""Weights to a changing fleet: one ``WeightPublisher.push`` against a raw c10d
broadcast of the same bytes, among the same processes, in the same run.

A publisher (this process) and 1 to 4 servers (processes of this script) meet on an
``agang store``. For each model size, the same processes first time the raw c10d path,
a ``ProcessGroupGloo`` broadcast of one flat tensor of the model's bytes followed by a
barrier (so the publisher knows that every server holds it), then open a channel and
time ``push`` (buckets, pipelined broadcasts, each server's confirmation). The model is
16 float32 tensors of equal size. The ratio is push / raw (target: at most 1.2x).
Raw rounds and pushes take turns, so both meet the same load; each server's application
takes each version (``receive``) before the next turn, as it would between a trainer's
pushes. Both subscriber modes are timed: ``in place`` (rounds write the server's
tensors) and ``staging`` (the default: rounds write a copy that ``receive`` copies in).

    python bench/bench_weights.py --quick     # 1 KiB, 1 MiB, 16 MiB; 1 and 2 servers
    python bench/bench_weights.py             # 1 KiB .. 256 MiB; 1 to 4 servers

It prints a table, writes ``weights.json`` and, with matplotlib, ``weights.png`` under
``--out`` (default bench/out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_out_argument, format_bytes, format_seconds, write_plots

from agang._membership import store as stores
from agang._weights.publisher import WeightPublisher
from agang._weights.subscriber import WeightSubscriber

TENSORS = 16
FULL_SIZES = [2**10, 2**16, 2**20, 2**24, 2**28]
QUICK_SIZES = [2**10, 2**20, 2**24]
#: The subscriber's modes: rounds write the server's tensors, or a staging copy that
#: ``receive`` copies in (the default).
MODES = ("in place", "staging")


def model(num_bytes: int) -> dict[str, torch.Tensor]:
    each = max(1, num_bytes // TENSORS // 4)
    return {f"layer{i}": torch.full((each,), float(i)) for i in range(TENSORS)}


def key(servers: int, size: int, mode: str, what: str) -> str:
    return f"bench/{servers}/{size}/{mode.replace(' ', '-')}/{what}"


def wait_taken(store: Any, servers: int, size: int, mode: str, version: int) -> None:
    """Waits (untimed) until every server's application took ``version``: pushes come
    at a trainer's pace, not back to back, so a server's copy out of its staging
    buffers happens between pushes (bounded: 30 s)."""
    give_up_at = time.monotonic() + 30.0
    for rank in range(1, servers + 1):
        taken = key(servers, size, mode, f"taken/{rank}")
        while time.monotonic() < give_up_at:
            if store.check([taken]) and int(store.get(taken).decode()) >= version:
                break
            time.sleep(0.0005)


def rounds_for(num_bytes: int, quick: bool) -> int:
    many = 20 if quick else 50
    return max(3, min(many, int(2**24 // max(num_bytes, 1))))


def raw_group(store: Any, servers: int, rank: int) -> Any:
    prefix = dist.PrefixStore(f"bench/raw/{servers}", store)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefix, rank, servers + 1, timedelta(seconds=120))  # type: ignore[attr-defined]


def raw_round(group: Any, flat: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([flat], options).wait()
    group.barrier(dist.BarrierOptions()).wait()


async def serve(address: str, servers: int, rank: int, sizes: list[int], quick: bool) -> None:
    store = connect(address)
    group = raw_group(store, servers, rank)
    for size in sizes:
        tensors = {k: torch.zeros_like(v) for k, v in model(size).items()}
        flat = torch.zeros(sum(t.numel() for t in tensors.values()))
        for mode in MODES:
            subscriber = await WeightSubscriber.open(
                tensors,
                store=address,
                channel=channel_of(servers, size, mode),
                name=f"server{rank}",
                in_place=mode == "in place",
            )
            admitted = int(store.get(key(servers, size, mode, "admitted")).decode())
            version = 0
            while version < admitted:
                version = await subscriber.receive(timeout=120)
            store.set(key(servers, size, mode, f"taken/{rank}"), str(version))
            for _ in range(rounds_for(size, quick) + 1):  # a raw round, then a push
                raw_round(group, flat)
                version = await subscriber.receive(timeout=120)
                store.set(key(servers, size, mode, f"taken/{rank}"), str(version))
            await subscriber.close()


def connect(address: str) -> Any:
    """A client of the bench's store, as the channel's sides make theirs."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + 60
    waits = stores.OP_SECONDS
    return stores.connect(host, int(port), deadline, need="The bench needs", op_seconds=waits)


def channel_of(servers: int, size: int, mode: str) -> str:
    return f"bench{servers}-{size}-{mode.replace(' ', '-')}"


async def publish(
    address: str, servers: int, sizes: list[int], quick: bool
) -> list[dict[str, Any]]:
    """For each size and mode: admits the servers, then times, turn by turn (so both
    see the same load), a raw round and a push; each server takes each version before
    the next raw round."""
    store = connect(address)
    group = raw_group(store, servers, 0)
    rows = []
    for size in sizes:
        tensors = model(size)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        flat = torch.cat([t for t in tensors.values()])
        count = rounds_for(size, quick)
        for mode in MODES:
            publisher = await WeightPublisher.open(
                tensors, store=address, channel=channel_of(servers, size, mode), timeout=120
            )
            version = 0
            for _ in range(200):  # the first push that reaches every server admits them
                version += 1
                if len((await publisher.push(version)).delivered) == servers:
                    break
                await asyncio.sleep(0.05)
            store.set(key(servers, size, mode, "admitted"), str(version))
            raw, pushes = [], []
            for turn in range(count + 1):  # turn 0 warms up
                wait_taken(store, servers, size, mode, version)
                started = time.perf_counter()
                raw_round(group, flat)
                raw_s = time.perf_counter() - started
                version += 1
                started = time.perf_counter()
                report = await publisher.push(version)
                push_s = time.perf_counter() - started
                assert len(report.delivered) == servers, report
                if turn:
                    raw.append(raw_s)
                    pushes.append(push_s)
            wait_taken(store, servers, size, mode, version)
            await publisher.close()
            raw_s, push_s = statistics.median(raw), statistics.median(pushes)
            rows.append(
                {
                    "servers": servers,
                    "bytes": nbytes,
                    "mode": mode,
                    "rounds": count,
                    "raw": raw_s,
                    "push": push_s,
                    "ratio": push_s / raw_s,
                }
            )
            print(
                f"{servers:>7}  {format_bytes(nbytes):>9}  {mode:>8}  {format_seconds(raw_s):>10}  "
                f"{format_seconds(push_s):>10}  {push_s / raw_s:>6.2f}x",
                flush=True,
            )
    return rows


def run(servers: int, sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    started: list[subprocess.Popen[str]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        store = subprocess.Popen(
            [sys.executable, "-m", "agang", "store", "--port", "0", "--quiet"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(store)
        assert store.stdout is not None
        address = store.stdout.readline().split()[-1]
        args = [str(s) for s in sizes] + (["--quick"] if quick else [])
        for rank in range(1, servers + 1):
            started.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--serve", address, str(servers), str(rank), *args],
                    env=env,
                    text=True,
                )
            )
        return asyncio.run(publish(address, servers, sizes, quick))
    finally:
        for process in reversed(started):  # ours, by pid
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="3 sizes, 1 and 2 servers")
    parser.add_argument(
        "--servers",
        type=int,
        nargs="+",
        help="server counts (default: %(default)s, meaning 1 2 3 4, or 1 2 with --quick)",
    )
    parser.add_argument(
        "--serve", nargs=3, metavar=("STORE", "SERVERS", "RANK"), help=argparse.SUPPRESS
    )
    parser.add_argument("sizes", type=int, nargs="*", help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.serve:
        address, servers, rank = args.serve
        asyncio.run(serve(address, int(servers), int(rank), args.sizes, args.quick))
        return 0
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    counts = args.servers or ([1, 2] if args.quick else [1, 2, 3, 4])
    print("servers      model      mode  raw bcast+barrier       push   ratio")
    rows = [row for servers in counts for row in run(servers, sizes, args.quick)]
    worst = max(row["ratio"] for row in rows)
    print(f"worst ratio {worst:.2f}x (target <= 1.2x)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights.json").write_text(
        json.dumps({"quick": args.quick, "rows": rows}, indent=1)
    )

    def draw(plt: Any) -> None:
        figure, axes = plt.subplots(figsize=(7, 4))
        for servers in counts:
            mine = [r for r in rows if r["servers"] == servers]
            axes.plot(
                [r["bytes"] for r in mine],
                [r["ratio"] for r in mine],
                marker="o",
                label=f"{servers} server(s)",
            )
        axes.set_xscale("log", base=2)
        axes.axhline(1.2, color="grey", linestyle="--", label="target 1.2x")
        axes.set_xlabel("model bytes")
        axes.set_ylabel("push / raw broadcast + barrier")
        axes.legend()
        figure.savefig(args.out / "weights.png", dpi=120, bbox_inches="tight")

    write_plots([args.out / "weights.png"], draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
