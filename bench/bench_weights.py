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

``--sharded``: a sharded trainer's push (``WeightPublisher.open(..., gang=)``). The
trainer is 2 ranks (``agang.testing.run_world``) holding the same 16 tensors as the
parameters of one module ``fully_shard``-ed on a 1-D CPU mesh (FSDP2: each rank holds
half of each tensor); one server (a process of this script) holds them whole, staging.
The hand-made baseline, in the same processes and taking turns with the pushes: rank 1
sends its shards to rank 0 (point to point, the fastest gather on Gloo), which receives
them into a flat buffer of the whole model at their offsets while it copies its own
in, then one raw c10d broadcast of that buffer to the server over a ``ProcessGroupGloo``
of {rank 0, server}, and a barrier. Both are timed on rank 0, each turn of each path
starting with both trainer ranks together (``meet``); the ratio is push / hand-made
(goal: at most 1.2x from 16 MiB up). A second baseline, also taking turns,
is the way the RL stacks gather by hand: every parameter's ``full_tensor()`` on both
ranks (an all-gather each, over the trainer's mesh), the whole model then one raw
broadcast from rank 0 and a barrier; push / ``full_tensor`` is printed beside the first
ratio. It also reports rank 0's extra memory:
the gathering's buffers (``publisher._gathering.allocated_bytes``; goal: at most 3
buckets), the rise of rank 0's peak resident memory (``VmHWM``, reset before) over the
publisher's open, admission and a push, and over the hand-made's first round (its
whole copy of the model); each trainer rank's CPU time (``time.process_time``, every
thread of the process) in a turn of each path (rank 0's printed, both ranks' in the
JSON), and the same by kind of thread (``threads_cpu``: the main thread, Gloo's socket
loops, Gloo's workers, the other threads; a line per size for rank 0); and whether the
server's bytes were exact on every path.

    python bench/bench_weights.py --sharded --quick   # 1 MiB, 16 MiB (about 15 s)
    python bench/bench_weights.py --sharded           # 16 MiB .. 1 GiB (about 1 min)
    python bench/bench_weights.py --sharded --timeline DIR 16777216   # where it goes

It writes ``weights_sharded.json`` and ``weights_sharded.png``. ``--timeline DIR`` also
marks, in each of the three processes, when a push's steps happened (the word to rank
1, its shares, each bucket gathered and broadcast, the server's confirmation, the
outcome's word) and prints each step's median time after the push's call, beside the
hand-made round's (``bench/sharded_timeline.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sharded_timeline as timeline
from _common import add_out_argument, format_bytes, format_seconds, write_plots

from agang._membership import store as stores
from agang._weights.publisher import WeightPublisher
from agang._weights.subscriber import WeightSubscriber
from agang.testing import run_world

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
    return dist.ProcessGroupGloo(prefix, rank, servers + 1, timedelta(seconds=120))


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
            version = await take_until(subscriber, admitted)
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
            version = await admit(publisher, servers)
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


@contextlib.contextmanager
def store_and_servers(sizes: list[int], quick: bool) -> Iterator[tuple[str, Callable[..., None]]]:
    """An ``agang store``'s address, and a call that starts a server (this script with
    the arguments given, then the sizes' and ``--quick``); every process started is
    killed by its pid at the end."""
    started: list[subprocess.Popen[str]] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sized = [str(s) for s in sizes] + (["--quick"] if quick else [])

    def start_server(*args: str) -> None:
        command = [sys.executable, __file__, *args, *sized]
        started.append(subprocess.Popen(command, env=env, text=True))

    try:
        store = subprocess.Popen(
            [sys.executable, "-m", "agang", "store", "--port", "0", "--quiet"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(store)
        assert store.stdout is not None
        yield store.stdout.readline().split()[-1], start_server
    finally:
        for process in reversed(started):  # ours, by pid
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


async def admit(publisher: WeightPublisher, servers: int) -> int:
    """Pushes until a push reaches all ``servers`` (the first that does admits them);
    returns its version."""
    version = 0
    for _ in range(200):
        version += 1
        if len((await publisher.push(version)).delivered) == servers:
            break
        await asyncio.sleep(0.05)
    return version


async def take_until(subscriber: WeightSubscriber, admitted: int) -> int:
    """Receives until the subscriber holds version ``admitted`` (the push that admitted
    it) or later; returns the version it holds."""
    version = 0
    while version < admitted:
        version = await subscriber.receive(timeout=120)
    return version


def run(servers: int, sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    with store_and_servers(sizes, quick) as (address, start_server):
        for rank in range(1, servers + 1):
            start_server("--serve", address, str(servers), str(rank))
        return asyncio.run(publish(address, servers, sizes, quick))


# --- Sharded mode (--sharded): a 2-rank FSDP2 trainer pushes to one whole server. ---

SHARDED_FULL_SIZES = [2**24, 2**26, 2**28, 2**30]
SHARDED_QUICK_SIZES = [2**20, 2**24]
#: The sharded trainer's ranks, and its mode's name in the keys and channels.
TRAINER_RANKS = 2
SHARDED = "sharded"
#: The issue's goals: push / hand-made at most 1.2x from 16 MiB up; the sender's
#: buffers at most 3 buckets.
SHARDED_RATIO_GOAL = 1.2
SHARDED_RATIO_FROM = 2**24
SHARDED_BUFFER_GOAL = 3


def sharded_rounds(num_bytes: int, quick: bool) -> int:
    """Timed turns per size: about 256 MiB (quick) or 4 GiB of each path's bytes, at
    least 3 (quick) or 8, at most 20 (quick) or 100: a median of a few turns moved by
    1.00-1.26x between runs on the 2-core machine."""
    least, many, budget = (3, 20, 2**28) if quick else (8, 100, 2**32)
    return max(least, min(many, budget // max(num_bytes, 1)))


def memory() -> dict[str, int]:
    """This process's resident bytes now (``VmRSS``) and at their peak (``VmHWM``)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0]) * 1024
    return found


def reset_peak() -> int | None:
    """Resets ``VmHWM`` to ``VmRSS`` (Linux's ``clear_refs`` 5) and returns the resident
    bytes it starts from; None where it cannot (the peaks then go unmeasured)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return memory()["VmRSS"]
    except (OSError, KeyError):
        return None


def peak_since(start: int | None) -> int | None:
    """How far ``VmHWM`` rose above ``start`` (``reset_peak``'s)."""
    return None if start is None else max(0, memory()["VmHWM"] - start)


#: ``threads_cpu``'s kinds of thread: by name, the rest is "other Python threads".
THREAD_KINDS = {"gloo_tcp_loop": "Gloo's socket loops", "pt_gloo_runloop": "Gloo's workers"}


def threads_cpu() -> dict[str, float] | None:
    """This process's CPU time so far, in ms, by kind of thread: the main thread, Gloo's
    socket loops (``gloo_tcp_loop``: the bytes into and out of the sockets), Gloo's
    workers (``pt_gloo_runloop``: a collective's algorithm, and agang's completion of it,
    which runs there), and the other Python threads (agang's waiters, which learn that
    a send or receive ended); None where ``/proc`` has no per-thread ``schedstat``."""
    totals: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                ns = int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        kind = "main" if task == str(os.getpid()) else THREAD_KINDS.get(name, "other threads")
        totals[kind] = totals.get(kind, 0.0) + ns / 1e6
    return totals or None


def add_since(into: dict[str, float], before: dict[str, float] | None) -> None:
    """Adds each kind's CPU since ``before`` (``threads_cpu``'s) to ``into``."""
    after = threads_cpu()
    if before is None or after is None:
        return
    for kind, ms in after.items():
        into[kind] = into.get(kind, 0.0) + ms - before.get(kind, 0.0)


def fsdp_model(num_bytes: int, mesh: Any) -> torch.nn.Module:
    """``model(num_bytes)``'s tensors as the parameters of one module, ``fully_shard``-ed
    on ``mesh`` (made on ``meta``, so no rank ever holds the whole), tensor i all i."""
    from torch.distributed.fsdp import fully_shard

    made = torch.nn.Module()
    with torch.device("meta"):
        for name, value in model(num_bytes).items():
            made.register_parameter(name, torch.nn.Parameter(value))
    fully_shard(made, mesh=mesh)
    made.to_empty(device="cpu")
    with torch.no_grad():
        for index, value in enumerate(made.state_dict().values()):
            value.to_local().fill_(float(index))
    return made


def spans(state: dict[str, Any], rank: int) -> list[tuple[int, int]]:
    """Where ``rank``'s shard of each tensor (``Shard(0)`` of a 1-D tensor, rows as
    ``torch.chunk`` cuts them) lies in the whole model's flat buffer: (offset, length),
    in elements."""
    out = []
    base = 0
    for value in state.values():
        whole = value.shape[0]
        step = -(-whole // TRAINER_RANKS)
        start = min(whole, rank * step)
        out.append((base + start, min(whole, start + step) - start))
        base += whole
    return out


def trainer_group(store: Any, rank: int) -> Any:
    """A raw Gloo group of the trainer's ranks: the hand-made gather's."""
    prefix = dist.PrefixStore("bench/sharded/trainer", store)  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(prefix, rank, TRAINER_RANKS, timedelta(seconds=120))


def meet(peers: Any) -> None:
    """Both trainer ranks start the next timed step together: a raw barrier of theirs,
    as a trainer's ranks come to a push together (a step's collectives line them up).
    Without it rank 1 came to each step ahead of rank 0, which still waited for the
    server after the step before, and the hand-made round was slower for it (9.9-11.1 ms
    at 16 MiB against 9.2-9.5 ms with it; ``docs/guides/weights.md``)."""
    peers.barrier(dist.BarrierOptions()).wait()


def hand_made(
    peers: Any, fleet: Any, flat: torch.Tensor, own: list[Any], theirs: list[Any]
) -> None:
    """The baseline on trainer rank 0: rank 1's shards received (point to point) into
    the whole model's flat buffer at their offsets while rank 0's own are copied in,
    then one broadcast of it to the server, and a barrier."""
    timeline.mark(timeline.HAND_START)
    works = [peers.recv([into], 1, tag) for tag, into in enumerate(theirs)]
    for into, local in own:
        into.copy_(local)
    for work in works:
        work.wait()
    timeline.mark("hand-made: shares came")
    raw_round(fleet, flat)
    timeline.mark("hand-made: broadcast and barrier ended")


def full_tensor_made(fleet: Any, state: dict[str, Any], flat: torch.Tensor) -> None:
    """The second baseline, on every trainer rank: each parameter's ``full_tensor()``
    (DTensor's all-gather over the trainer's mesh, the RL stacks' way), then, on rank 0
    (``fleet`` not None), the whole model into ``flat``, one raw broadcast of it to the
    server, and a barrier."""
    whole = [value.full_tensor() for value in state.values()]
    if fleet is not None:
        torch.cat(whole, out=flat)
        raw_round(fleet, flat)


def hand_made_share(peers: Any, shares: list[torch.Tensor]) -> None:
    """The baseline on trainer rank 1: its shards sent to rank 0."""
    works = [peers.send([local], 0, tag) for tag, local in enumerate(shares)]
    for work in works:
        work.wait()


def wait_key(store: Any, name: str, seconds: float = 120.0) -> bytes:
    """``name``'s value once it is set (bounded)."""
    give_up_at = time.monotonic() + seconds
    while not store.check([name]):
        if time.monotonic() > give_up_at:
            raise TimeoutError(f"{name} was not set within {seconds:g} s")
        time.sleep(0.001)
    return store.get(name)  # type: ignore[no-any-return]


async def sharded_rank(
    address: str, sizes: list[int], quick: bool, bucket_bytes: int | None, gang: Any
) -> list[Any]:
    """A trainer rank (``run_world``): for each size, an FSDP2 model, a publisher over
    ``gang`` admitting the server, then turns of a hand-made round and a push, timed on
    rank 0 (rank 1 takes part, and measures its own peak)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    rank = gang.rank
    timeline.install(f"rank {rank}")
    store = connect(address)
    mesh = init_device_mesh("cpu", (TRAINER_RANKS,))
    peers = trainer_group(store, rank)
    fleet = raw_group(store, 1, 0) if rank == 0 else None
    rows = []
    for size in sizes:
        made = fsdp_model(size, mesh)
        state = made.state_dict()
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        count = sharded_rounds(size, quick)
        # The publisher's memory: open, admission, and a push to the server.
        start = reset_peak()
        publisher = await WeightPublisher.open(
            state,
            store=address,
            channel=channel_of(1, size, SHARDED),
            timeout=120,
            gang=gang,
            bucket_bytes=bucket_bytes,
        )
        version = await admit(publisher, 1)
        if rank == 0:
            store.set(key(1, size, SHARDED, "admitted"), str(version))
            wait_taken(store, 1, size, SHARDED, version)
        version += 1
        assert (await publisher.push(version)).delivered
        if rank == 0:
            wait_taken(store, 1, size, SHARDED, version)
        push_peak = peak_since(start)
        gathering = publisher._gathering if rank == 0 else None  # the sender's (rule 9)
        buffers = gathering.allocated_bytes if gathering is not None else 0
        # The hand-made's memory: its whole flat buffer, and its first round.
        start = reset_peak()
        shares = [value.to_local() for value in state.values()]
        assert [t.numel() for t in shares] == [n for _, n in spans(state, rank)], "shards"
        flat = torch.empty(nbytes // 4 if rank == 0 else 0)
        # The full_tensor round's own (untouched until its first round): neither baseline
        # sends what the other gathered, so the server checks each one's bytes.
        full_flat = torch.empty_like(flat)
        own = [(flat[at : at + n], t) for (at, n), t in zip(spans(state, 0), shares, strict=True)]
        theirs = [flat[at : at + n] for at, n in spans(state, 1)]
        if rank:
            own, theirs = [], []
        if rank == 0:  # its marks line the turns up (bench/sharded_timeline.py)
            timeline.mark(f"{timeline.TIMED}{format_bytes(nbytes)}")
        hand, full, pushes, reported, cpu_hand, cpu_push = [], [], [], [], [], []
        hand_peak: int | None = None
        threads_hand: dict[str, float] = {}  # CPU by kind of thread, over the timed turns
        threads_push: dict[str, float] = {}
        for turn in range(count + 1):  # turn 0 warms up
            meet(peers)
            before = threads_cpu() if turn else None
            started, cpu = time.perf_counter(), time.process_time()
            if rank == 0:
                hand_made(peers, fleet, flat, own, theirs)
            else:
                hand_made_share(peers, shares)
            hand_s, hand_cpu = time.perf_counter() - started, time.process_time() - cpu
            add_since(threads_hand, before)
            if turn == 0:
                hand_peak = peak_since(start)
            meet(peers)
            started = time.perf_counter()
            full_tensor_made(fleet, state, full_flat)
            full_s = time.perf_counter() - started
            version += 1
            meet(peers)
            before = threads_cpu() if turn else None
            started, cpu = time.perf_counter(), time.process_time()
            report = await publisher.push(version)
            push_s, push_cpu = time.perf_counter() - started, time.process_time() - cpu
            add_since(threads_push, before)
            assert report.delivered, report
            if rank == 0:
                wait_taken(store, 1, size, SHARDED, version)
            if turn:
                hand.append(hand_s)
                full.append(full_s)
                pushes.append(push_s)
                reported.append(report.seconds)
                cpu_hand.append(hand_cpu)
                cpu_push.append(push_cpu)
        if rank == 0:
            timeline.mark(timeline.UNTIMED)
        await publisher.close()
        row: dict[str, Any] = {
            "rank": rank,
            "push_peak": push_peak,
            "hand_peak": hand_peak,
            # This process's CPU (every thread's) in a turn of each path, medians.
            "cpu_hand": statistics.median(cpu_hand),
            "cpu_push": statistics.median(cpu_push),
            # The same, by kind of thread, as a mean over the timed turns (ms a turn).
            "cpu_threads_hand": {k: v / count for k, v in sorted(threads_hand.items())},
            "cpu_threads_push": {k: v / count for k, v in sorted(threads_push.items())},
        }
        if rank == 0:
            exact = wait_key(store, key(1, size, SHARDED, "exact")).decode()
            hand_s, push_s = statistics.median(hand), statistics.median(pushes)
            full_s = statistics.median(full)
            row |= {
                "bytes": nbytes,
                "bucket_bytes": publisher.plan.bucket_bytes,
                "rounds": count,
                "hand_made": hand_s,
                "full_tensor": full_s,
                "push": push_s,
                "push_reported": statistics.median(reported),
                "ratio": push_s / hand_s,
                "ratio_full_tensor": push_s / full_s,
                "buffers": buffers,
                "exact": exact,
            }
            print(sharded_line(row), flush=True)
        rows.append(row)
        del made, state, publisher, flat, full_flat, own, theirs, shares
    timeline.dump()
    return rows


async def serve_sharded(address: str, sizes: list[int], quick: bool) -> None:
    """The whole server (``--serve-sharded``): for each size, a staging subscriber that
    takes every version, and its part of each round of both baselines (broadcast,
    barrier), each into a flat buffer of its own; at the end of a size it checks every
    path's bytes and says so under ``exact``."""
    torch.set_num_threads(1)
    timeline.install("server")
    store = connect(address)
    group = raw_group(store, 1, 1)
    for size in sizes:
        tensors = {k: torch.zeros_like(v) for k, v in model(size).items()}
        flat = torch.zeros(sum(t.numel() for t in tensors.values()))
        full_flat = torch.zeros_like(flat)
        subscriber = await WeightSubscriber.open(
            tensors, store=address, channel=channel_of(1, size, SHARDED), name="server"
        )
        taken = key(1, size, SHARDED, "taken/1")
        admitted = int(wait_key(store, key(1, size, SHARDED, "admitted")).decode())
        version = await take_until(subscriber, admitted)
        store.set(taken, str(version))
        version = await subscriber.receive(timeout=120)  # the memory window's push
        store.set(taken, str(version))
        for _ in range(sharded_rounds(size, quick) + 1):  # both baselines, then a push
            raw_round(group, flat)  # the hand-made round
            raw_round(group, full_flat)  # the full_tensor round
            version = await subscriber.receive(timeout=120)
            store.set(taken, str(version))
        wrong = [n for i, (n, t) in enumerate(tensors.items()) if not bool((t == i).all())]
        expected = torch.cat([torch.full_like(t, i) for i, t in enumerate(tensors.values())])
        if not torch.equal(flat, expected):
            wrong.append("the hand-made's flat buffer")
        if not torch.equal(full_flat, expected):
            wrong.append("the full_tensor round's flat buffer")
        timeline.dump()  # before the size ends: the bench kills this process at its end
        store.set(key(1, size, SHARDED, "exact"), "yes" if not wrong else f"no: {wrong}")
        await subscriber.close()
        del tensors, flat, full_flat, expected


SHARDED_HEADER = (
    "    model  bucket  rounds   hand-made        push   ratio  full_tensor  ratio  "
    "agang buffers  /bucket  /model  push peak  hand-made peak  "
    "rank 0's CPU: push / hand-made  exact"
)


def mib(num_bytes: int | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**20:.1f} MiB"


def sharded_line(row: dict[str, Any]) -> str:
    return (
        f"{format_bytes(row['bytes']):>9}  {format_bytes(row['bucket_bytes']):>6}  "
        f"{row['rounds']:>6}  {format_seconds(row['hand_made']):>10}  "
        f"{format_seconds(row['push']):>10}  {row['ratio']:>5.2f}x  "
        f"{format_seconds(row['full_tensor']):>11}  {row['ratio_full_tensor']:>5.2f}x  "
        f"{mib(row['buffers']):>13}  {row['buffers'] / row['bucket_bytes']:>6.2f}x  "
        f"{row['buffers'] / row['bytes']:>5.3f}x  {mib(row['push_peak']):>9}  "
        f"{mib(row['hand_peak']):>14}  "
        f"{format_seconds(row['cpu_push']):>9} / {format_seconds(row['cpu_hand']):<9}  "
        f"{row['exact']}"
    )


def threads_line(row: dict[str, Any]) -> str:
    """Rank 0's CPU in a turn, by kind of thread (``threads_cpu``): push / hand-made."""
    push, hand = row["cpu_threads_push"], row["cpu_threads_hand"]
    kinds = ["main", *THREAD_KINDS.values(), "other threads"]
    parts = [
        f"{kind} {push.get(kind, 0.0):.2f} / {hand.get(kind, 0.0):.2f}"
        for kind in kinds
        if kind in push or kind in hand
    ]
    return f"{format_bytes(row['bytes']):>9}  rank 0's CPU ms a turn, push / hand-made: " + (
        ", ".join(parts) or "not measured (no per-thread schedstat)"
    )


def run_sharded(sizes: list[int], quick: bool, bucket_bytes: int | None) -> list[dict[str, Any]]:
    """An ``agang store``, the server (a process of this script) and the trainer's 2
    ranks (``run_world``); the rows, rank 0's with rank 1's peaks as ``rank1_*``."""
    with store_and_servers(sizes, quick) as (address, start_server):
        start_server("--serve-sharded", address)
        ranks = run_world(
            functools.partial(sharded_rank, address, sizes, quick, bucket_bytes),
            TRAINER_RANKS,
            timeout=120 + 60 * len(sizes) if quick else 1800,
        )
    rows = []
    for first, second in zip(ranks[0], ranks[1], strict=True):
        rows.append(
            {
                **first,
                "rank1_push_peak": second["push_peak"],
                "rank1_hand_peak": second["hand_peak"],
                "rank1_cpu_hand": second["cpu_hand"],
                "rank1_cpu_push": second["cpu_push"],
                "rank1_cpu_threads_hand": second["cpu_threads_hand"],
                "rank1_cpu_threads_push": second["cpu_threads_push"],
            }
        )
    return rows


def main_sharded(args: argparse.Namespace) -> int:
    sizes = args.sizes or (SHARDED_QUICK_SIZES if args.quick else SHARDED_FULL_SIZES)
    print(
        f"A {TRAINER_RANKS}-rank FSDP2 trainer (gang) pushes to 1 whole server (staging); "
        f"hand-made: gather onto rank 0 point to point, raw broadcast + barrier; "
        f"full_tensor: each parameter's full_tensor(), raw broadcast + barrier"
    )
    print(SHARDED_HEADER, flush=True)
    if args.timeline is not None:  # the processes started from here on read it
        args.timeline.mkdir(parents=True, exist_ok=True)
        for old in args.timeline.glob("*.txt"):
            old.unlink()
        os.environ[timeline.ENV] = str(args.timeline.resolve())
    rows = run_sharded(sizes, args.quick, args.bucket_bytes)
    if args.timeline is not None:
        print(timeline.summary(args.timeline))
    large = [row["ratio"] for row in rows if row["bytes"] >= SHARDED_RATIO_FROM]
    if large:
        print(
            f"worst ratio from {format_bytes(SHARDED_RATIO_FROM)} up {max(large):.2f}x "
            f"(goal <= {SHARDED_RATIO_GOAL}x); against full_tensor "
            f"{max(r['ratio_full_tensor'] for r in rows if r['bytes'] >= SHARDED_RATIO_FROM):.2f}x"
        )
    for row in rows:
        print(threads_line(row))
    most = max(row["buffers"] / row["bucket_bytes"] for row in rows)
    print(f"most sender buffers {most:.2f} buckets (goal <= {SHARDED_BUFFER_GOAL})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weights_sharded.json").write_text(
        json.dumps(
            {"quick": args.quick, "trainer_ranks": TRAINER_RANKS, "servers": 1, "rows": rows},
            indent=1,
        )
    )

    def draw(plt: Any) -> None:
        figure, (ratio, extra) = plt.subplots(1, 2, figsize=(11, 4))
        sizes = [r["bytes"] for r in rows]
        ratio.plot(sizes, [r["ratio"] for r in rows], marker="o", label="push / hand-made")
        ratio.plot(
            sizes,
            [r["ratio_full_tensor"] for r in rows],
            marker="o",
            label="push / full_tensor + broadcast",
        )
        ratio.axhline(SHARDED_RATIO_GOAL, color="grey", linestyle="--", label="goal 1.2x")
        ratio.set_xscale("log", base=2)
        ratio.set_xlabel("model bytes")
        ratio.set_ylabel("push / baseline (gather + broadcast + barrier)")
        ratio.legend()
        lines = {
            "model": sizes,
            "agang sender buffers": [r["buffers"] for r in rows],
            "agang rank 0 peak rise": [r["push_peak"] for r in rows],
            "hand-made rank 0 peak rise": [r["hand_peak"] for r in rows],
            f"{SHARDED_BUFFER_GOAL} buckets": [
                SHARDED_BUFFER_GOAL * r["bucket_bytes"] for r in rows
            ],
        }
        for label, values in lines.items():
            if None not in values:
                style = "--" if label in ("model", f"{SHARDED_BUFFER_GOAL} buckets") else "-"
                extra.plot(sizes, values, linestyle=style, marker="o", label=label)
        extra.set_xscale("log", base=2)
        extra.set_yscale("log", base=2)
        extra.set_xlabel("model bytes")
        extra.set_ylabel("trainer rank 0's extra bytes")
        extra.legend(fontsize="small")
        figure.savefig(args.out / "weights_sharded.png", dpi=120, bbox_inches="tight")

    write_plots([args.out / "weights_sharded.png"], draw)
    return 0


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
        "--sharded",
        action="store_true",
        help="a 2-rank FSDP2 trainer pushing to 1 server, against a hand-made gather and "
        "broadcast (16 MiB to 1 GiB, or 1 and 16 MiB with --quick)",
    )
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="--sharded: the publisher's bucket_bytes (default: its own, 16 MiB over a gang)",
    )
    parser.add_argument(
        "--serve", nargs=3, metavar=("STORE", "SERVERS", "RANK"), help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--timeline",
        type=Path,
        metavar="DIR",
        help="--sharded: also mark where each push's time goes, in every process, write "
        "the marks under DIR and print each mark's median time (bench/sharded_timeline.py)",
    )
    parser.add_argument("--serve-sharded", metavar="STORE", help=argparse.SUPPRESS)
    parser.add_argument("sizes", type=int, nargs="*", help=argparse.SUPPRESS)
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.serve:
        address, servers, rank = args.serve
        asyncio.run(serve(address, int(servers), int(rank), args.sizes, args.quick))
        return 0
    if args.serve_sharded:
        asyncio.run(serve_sharded(args.serve_sharded, args.sizes, args.quick))
        return 0
    if args.sharded:
        return main_sharded(args)
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
