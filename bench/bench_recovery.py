"""Recovery from a SIGKILLed worker: an elastic gang's reform against a torchrun restart.

Method:
    Each repetition starts 4 workers on 127.0.0.1 over Gloo, which all-reduce a small
    tensor every 5 ms. Once every worker has done 20 all-reduces, the parent SIGKILLs one
    of them by pid (worker ``repetition % 4``, so every rank is the victim in turn), and
    times from just before the kill to the moment the last worker finished its first
    all-reduce in the new world:

    - ``agang reform``: the workers form an elastic gang (``agang.init(elastic=...)``) on
      an ``agang store`` of its own; the survivors' failed op raises, they ``reform()``
      and all-reduce once. Run with ``op_timeout`` 2 s and 10 s: a dead peer's
      neighbours see its connection drop, and a member that starts a reform breaks the
      others' gang at once, so neither deadline should be waited out.
    - ``torchrun restart``: the workers run under ``torchrun --max-restarts 1`` (c10d
      rendezvous on 127.0.0.1, its default ``--monitor-interval``) with plain
      ``torch.distributed``; the agent sees the death, stops the other three, and starts
      all four again, which import torch, make their process group and all-reduce once.

    The three modes take turns within each repetition (the order rotated each time), so
    drift and background load hit them alike. The table gives each mode's median, min and
    max over the repetitions, and the ratio of each median to the first mode's.

    ``waiting_to_join()``, the local read each step boundary makes, is timed in rank 0 of
    every ``agang`` run (100,000 calls, the mean per call), next to the
    ``agang.broadcast_flag`` (one collective) that the step boundary makes anyway.

Usage:
    python bench/bench_recovery.py             # 5 repetitions of each mode, ~2.5 min here
    python bench/bench_recovery.py --reps 2    # a smoke test

Writes ``bench/out/recovery.json`` (every repetition's times).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"
WORKERS = 4
OPS_BEFORE_KILL = 20
PAUSE = 0.005  # between two all-reduces
JOIN_CALLS = 100_000
FLAG_CALLS = 200
EVENT = "EVENT "
WAIT = 60.0  # the longest any one wait of a repetition may take
OUT_DIR = Path(__file__).resolve().parent / "out"
MODES = ("agang reform, op_timeout 2 s", "agang reform, op_timeout 10 s", "torchrun restart")


# -- the workers -----------------------------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
    line = EVENT + json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: whole even on a shared pipe


async def agang_worker(op_timeout: float) -> None:
    """An elastic gang's member: all-reduces until a peer dies, reforms, all-reduces once."""
    import anyio
    import torch

    import agang

    gang = await agang.init(elastic=agang.Elastic(min_size=2), timeout=WAIT, op_timeout=op_timeout)
    await time_the_step_boundary(gang)
    done = 0
    while True:
        try:
            await gang.all_reduce(torch.ones(4))
        except agang.GangError:
            break
        done += 1
        if done == OPS_BEFORE_KILL:
            emit("ready")
        await anyio.sleep(PAUSE)
    gang = await gang.reform(timeout=WAIT)
    await gang.all_reduce(torch.ones(4))
    emit("recovered", at=time.monotonic(), size=gang.size)
    await gang.close()


async def time_the_step_boundary(gang: Any) -> None:
    """The mean cost of ``waiting_to_join()`` and, for scale, of ``broadcast_flag``
    (a collective: every worker calls it); rank 0 reports."""
    import agang

    started = time.perf_counter()
    for _ in range(JOIN_CALLS):
        gang.waiting_to_join()
    join = (time.perf_counter() - started) / JOIN_CALLS
    started = time.perf_counter()
    for _ in range(FLAG_CALLS):
        await agang.broadcast_flag(gang, False)
    flag = (time.perf_counter() - started) / FLAG_CALLS
    if gang.rank == 0:
        emit("step boundary", waiting_to_join=join, broadcast_flag=flag)


def torchrun_worker() -> None:
    """Under torchrun: all-reduces until stopped; restarted, makes its group, all-reduces
    once and reports when."""
    import torch
    import torch.distributed as dist

    # The restart count in the keys: with plain env:// set-up, the restarted workers'
    # Gloo group failed to connect here (torch 2.13: "connection refused" to a peer's
    # address), every time; a prefix per attempt keeps each attempt's keys apart.
    store = dist.PrefixStore(  # type: ignore[attr-defined]
        f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
        dist.TCPStore(  # type: ignore[attr-defined]
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        ),
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    if os.environ["TORCHELASTIC_RESTART_COUNT"] != "0":
        dist.all_reduce(torch.ones(4))
        emit("recovered", at=time.monotonic(), size=dist.get_world_size())
        dist.destroy_process_group()
        return
    for done in range(1, 10**9):
        dist.all_reduce(torch.ones(4))
        if done == OPS_BEFORE_KILL:
            emit("ready", rank=dist.get_rank())
        time.sleep(PAUSE)


# -- the parent ----------------------------------------------------------------------


class Events:
    """What the processes of one repetition print: events on a queue, other lines kept
    for an error report. Every wait is bounded."""

    def __init__(self) -> None:
        self.queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.log: list[str] = []

    def follow(self, stream: IO[str] | None) -> None:
        assert stream is not None
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(EVENT):
                self.queue.put(json.loads(line[len(EVENT) :]))
            else:
                self.log.append(line.rstrip("\n"))

    def wait_for(self, kind: str, count: int, deadline: float) -> list[dict[str, Any]]:
        """The next ``count`` events of ``kind`` by ``deadline`` (the others are kept)."""
        found: list[dict[str, Any]] = []
        while len(found) < count:
            try:
                event = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = "\n".join(self.log[-30:])
                raise TimeoutError(f"{count} {kind!r} events not seen in time:\n{tail}") from None
            self.seen.append(event)
            if event["kind"] == kind:
                found.append(event)
        return found


class Processes:
    """The processes of one repetition (and the workers torchrun started for it, by
    the pids they report), all ended by pid at the end, whatever happened."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.started: list[subprocess.Popen[str]] = []

    def start(self, command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.started.append(process)
        self.events.follow(process.stdout)
        self.events.follow(process.stderr)
        return process

    def stop(self) -> None:
        for process in reversed(self.started):  # workers first, the store or agent last
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        for pid in {event["pid"] for event in self.events.seen}:
            if is_torchrun_worker(pid):  # left behind by an agent that did not stop them
                os.kill(pid, signal.SIGKILL)


def is_torchrun_worker(pid: int) -> bool:
    """Whether ``pid`` is still one of this bench's torchrun workers (not a reused pid)."""
    try:
        return b"--torchrun-worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def environment(**extra: str) -> dict[str, str]:
    """This environment without another job's world; one CPU thread per process."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        and not name.startswith("TORCHELASTIC_")
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def store_port(processes: Processes, deadline: float) -> int:
    """Starts an ``agang store`` on 127.0.0.1 (a free port); the port, from its first line."""
    store = processes.start(
        [sys.executable, "-m", "agang", "store", "--host", HOST, "--port", "0", "--quiet"],
        environment(),
    )
    while time.monotonic() < deadline and store.poll() is None:
        for line in list(processes.events.log):
            if line.startswith("agang store listening on "):
                return int(line.rsplit(":", 1)[1])
        time.sleep(0.02)
    raise TimeoutError(f"`agang store` did not start: {processes.events.log[-10:]}")


@dataclass
class Repetition:
    """One kill and recovery: seconds from the SIGKILL to the last worker's first
    all-reduce in the new world."""

    mode: str
    victim: int
    seconds: float
    sizes: list[int]
    boundary: dict[str, Any] | None = None


def run_agang(mode: str, op_timeout: float, victim: int) -> Repetition:
    events = Events()
    processes = Processes(events)
    deadline = time.monotonic() + WAIT
    try:
        port = store_port(processes, deadline)
        workers = [
            processes.start(
                [sys.executable, __file__, "--agang-worker", str(op_timeout)],
                environment(
                    MASTER_ADDR=HOST,
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    WORLD_SIZE=str(WORKERS),
                    LOCAL_RANK=str(rank),
                ),
            )
            for rank in range(WORKERS)
        ]
        events.wait_for("ready", WORKERS, deadline)
        killed_at = time.monotonic()
        os.kill(workers[victim].pid, signal.SIGKILL)
        recovered = events.wait_for("recovered", WORKERS - 1, time.monotonic() + WAIT)
        boundary = next(e for e in events.seen if e["kind"] == "step boundary")
        seconds = max(e["at"] for e in recovered) - killed_at
        return Repetition(mode, victim, seconds, [e["size"] for e in recovered], boundary)
    finally:
        processes.stop()


def run_torchrun(mode: str, victim: int) -> Repetition:
    events = Events()
    processes = Processes(events)
    deadline = time.monotonic() + WAIT
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
    command += ["--nproc-per-node", str(WORKERS), "--max-restarts", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HOST}:0"]
    command += [__file__, "--torchrun-worker"]
    try:
        processes.start(command, environment())
        ready = events.wait_for("ready", WORKERS, deadline)
        killed_at = time.monotonic()
        os.kill(next(e["pid"] for e in ready if e["rank"] == victim), signal.SIGKILL)
        recovered = events.wait_for("recovered", WORKERS, time.monotonic() + WAIT)
        seconds = max(e["at"] for e in recovered) - killed_at
        return Repetition(mode, victim, seconds, [e["size"] for e in recovered])
    finally:
        processes.stop()


def run(mode: str, victim: int) -> Repetition:
    if mode == MODES[2]:
        return run_torchrun(mode, victim)
    return run_agang(mode, 2.0 if mode == MODES[0] else 10.0, victim)


def table(results: list[Repetition]) -> list[str]:
    rows = [f"{'mode':<32} {'median':>8} {'min':>8} {'max':>8}  vs agang (2 s)"]
    base = statistics.median(r.seconds for r in results if r.mode == MODES[0])
    for mode in MODES:
        times = [r.seconds for r in results if r.mode == mode]
        median = statistics.median(times)
        rows.append(
            f"{mode:<32} {median:>7.2f}s {min(times):>7.2f}s {max(times):>7.2f}s  "
            f"{median / base:.2f}x"
        )
    boundaries = [r.boundary for r in results if r.boundary is not None]
    join = statistics.median(b["waiting_to_join"] for b in boundaries)
    flag = statistics.median(b["broadcast_flag"] for b in boundaries)
    rows.append(
        f"waiting_to_join(): {join * 1e6:.2f} us per call; broadcast_flag: {flag * 1e6:.0f} us "
        f"per call ({flag / join:.0f}x); medians of {len(boundaries)} runs' means (rank 0)"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each mode")
    parser.add_argument("--agang-worker", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agang_worker is not None:
        import anyio

        anyio.run(agang_worker, args.agang_worker)
        return
    if args.torchrun_worker:
        torchrun_worker()
        return
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, but is {args.reps}")
    import torch

    print(
        f"{WORKERS} Gloo workers on {HOST}, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.reps} "
        f"repetitions of each mode; seconds from a worker's SIGKILL to the last worker's "
        f"first all-reduce in the new world",
        flush=True,
    )
    results: list[Repetition] = []
    for rep in range(args.reps):
        for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
            result = run(mode, victim=rep % WORKERS)
            results.append(result)
            print(
                f"  rep {rep}: {mode}: rank {result.victim} killed, "
                f"{result.seconds:.2f} s, new world {sorted(set(result.sizes))}",
                flush=True,
            )
    print()
    for row in table(results):
        print(row)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "recovery.json").write_text(
        json.dumps([r.__dict__ for r in results], indent=1) + "\n"
    )
    print(f"Wrote {OUT_DIR / 'recovery.json'}.")


if __name__ == "__main__":
    main()
