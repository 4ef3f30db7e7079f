"""Elastic data-parallel training: a worker is killed, the survivors go on, a replacement joins.

This script is the whole job: it starts an ``agang store`` on 127.0.0.1 and ``--workers``
worker processes around it (not under torchrun, whose agent would stop the survivors
when one worker dies), and ends every process it started, by pid, however it exits.

Each worker trains a replica of a small MLP with ``agang.GradientSync`` on its own shard
of synthetic regression data. ``--kill RANK --at-step S``: the worker of that rank
SIGKILLs itself at the start of step S, as a crash would. The survivors' pending ops
fail, they ``reform()`` into the next epoch's gang, take the step and the model's
weights from its rank 0 by broadcast, and go on from there. ``--respawn``: once they
have, the script starts a replacement, which waits in ``agang.init(elastic=...)``; at the
next step boundary the members agree, with one ``agang.broadcast_flag``, that someone
waits to join, and all call ``reform()`` to admit it.

    python examples/elastic_trainer.py --workers 4 --kill 2 --at-step 20 --respawn

It prints a timeline (step, epoch, world size, time to recover) and the final loss, and
exits 0 when training finished as planned (1 otherwise, 2 on a usage error).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HOST = "127.0.0.1"  # the store and every worker bind loopback only
DIMENSIONS = (16, 4)  # inputs, outputs
REFORM_TIMEOUT = 30.0  # seconds a reform may take
STORE_START_TIMEOUT = 30.0  # seconds for `agang store` to say where it listens
STOP_GRACE = 5.0  # seconds a process gets to exit after SIGTERM, before SIGKILL
EVENT = "EVENT "  # a worker's stdout lines that start so are events for the timeline


# -- arguments ------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: every error names the parameter (status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=4, help="worker processes (1-64)")
    parser.add_argument("--steps", type=int, default=200, help="training steps in all")
    parser.add_argument("--kill", type=int, metavar="RANK", help="the rank to SIGKILL")
    parser.add_argument("--at-step", type=int, metavar="S", help="the step it dies at")
    parser.add_argument(
        "--respawn", action="store_true", help="start a replacement for the killed worker"
    )
    parser.add_argument(
        "--min-size", type=int, default=1, help="the fewest members a reform accepts"
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per worker and step")
    parser.add_argument("--hidden", type=int, default=64, help="width of the MLP")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD learning rate")
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.1,
        help="the least time a step takes (a pause after a fast one), so that a "
        "replacement has time to start mid-run",
    )
    parser.add_argument("--op-timeout", type=float, default=10.0, help="each op's deadline")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data")
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    # A worker's own arguments: set by the script when it starts one.
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--die-at-step", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problem = check(args)
    if problem is not None:
        parser.error(problem)
    return args


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (naming the parameter), or None."""
    if not 1 <= args.workers <= 64:
        return f"--workers must be between 1 and 64, but is {args.workers}"
    for name in ("steps", "batch", "hidden"):
        if getattr(args, name) < 1:
            return f"--{name} must be at least 1, but is {getattr(args, name)}"
    for name in ("lr", "op_timeout", "timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, but is {getattr(args, name)}"
    if not args.step_seconds >= 0:
        return f"--step-seconds must be at least 0, but is {args.step_seconds}"
    if not 1 <= args.min_size <= args.workers:
        return (
            f"--min-size must be between 1 and --workers ({args.workers}), but is {args.min_size}"
        )
    if (args.kill is None) != (args.at_step is None):
        return "--kill and --at-step go together: give both, or neither"
    if args.respawn and args.kill is None:
        return "--respawn replaces a killed worker: it needs --kill and --at-step"
    if args.kill is not None:
        if args.workers < 2:
            return "--kill needs --workers of at least 2, so that a worker survives"
        if not 0 <= args.kill < args.workers:
            return f"--kill must be a rank from 0 to {args.workers - 1}, but is {args.kill}"
        if not 0 <= args.at_step < args.steps:
            return (
                f"--at-step must be from 0 to --steps - 1 ({args.steps - 1}), but is {args.at_step}"
            )
        if args.min_size > args.workers - 1:
            return (
                f"--min-size ({args.min_size}) must be at most --workers - 1 "
                f"({args.workers - 1}) with --kill, or the survivors cannot reform"
            )
    return None


# -- the worker: one process of the gang -------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
    """Tells the script something for its timeline (one line on stdout)."""
    line = EVENT + json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: whole even on a shared pipe


def make_model(args: argparse.Namespace) -> Any:
    import torch

    # Seeded by pid on purpose: replicas start apart, and rank 0's broadcast makes them equal.
    torch.manual_seed(os.getpid())
    inputs, outputs = DIMENSIONS
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, args.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, outputs),
    )


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[Any, Any]:
    """Shard ``rank`` of step ``step``: a fixed teacher map plus noise."""
    import torch

    teacher = torch.Generator().manual_seed(args.seed)
    weight = torch.randn(DIMENSIONS, generator=teacher)
    data = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1009 + rank)
    x = torch.randn(args.batch, DIMENSIONS[0], generator=data)
    y = torch.tanh(x @ weight) + 0.01 * torch.randn(args.batch, DIMENSIONS[1], generator=data)
    return x, y


@dataclass
class Worker:
    """One worker's training state; the gang and its GradientSync change at each epoch."""

    args: argparse.Namespace
    gang: Any
    model: Any
    optimizer: Any
    sync: Any = None
    step: int = 0

    async def adopt(self, cause: str, since: float) -> None:
        """Takes the epoch's state from its rank 0 (the step, then the weights, by
        broadcast, in ``GradientSync.ready()``) and reports the epoch."""
        import torch

        import agang

        if self.sync is not None:
            self.sync.remove()
        self.optimizer.zero_grad(set_to_none=True)  # the old buckets' views go
        self.sync = agang.GradientSync(self.model, self.gang)
        step = torch.tensor([self.step], dtype=torch.int64)
        self.step = int((await self.gang.broadcast(step, 0)).item())
        await self.sync.ready()
        ready_at = time.monotonic()
        emit(
            "epoch",
            epoch=self.gang.epoch,
            rank=self.gang.rank,
            size=self.gang.size,
            step=self.step,
            cause=cause,
            took=ready_at - since,
            ready_at=ready_at,
        )

    async def reform(self, cause: str, since: float) -> None:
        """The next epoch: survivors and joiners, then rank 0's state."""
        self.gang = await self.gang.reform(timeout=REFORM_TIMEOUT)
        await self.adopt(cause, since)

    async def recover(self, since: float, attempts: int = 3) -> None:
        """Reforms after a failure; a member lost during the reform's broadcasts makes
        it reform again (a reform that cannot gather ``--min-size`` raises)."""
        import agang

        for attempt in range(attempts):
            try:
                await self.reform("survived a failure", since)
                return
            except agang.GangInitError:
                raise
            except agang.GangError:
                if attempt == attempts - 1:
                    raise

    async def train_step(self) -> float:
        """One synchronised step on this rank's shard; the loss averaged over the gang."""
        import torch

        import agang

        x, y = batch(self.args, self.step, self.gang.rank)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        mean_loss = self.gang.all_reduce(loss.detach().clone(), agang.ReduceOp.MEAN)
        loss.backward()  # buckets are all-reduced as backward fills them
        await self.sync.wait()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float((await mean_loss).item())


async def run_worker(args: argparse.Namespace) -> int:
    """A worker's life: join the gang, train, survive failures, admit joiners."""
    import anyio
    import torch

    import agang

    torch.set_num_threads(1)
    started = time.monotonic()
    gang = await agang.init(
        elastic=agang.Elastic(min_size=args.min_size, max_size=args.workers),
        timeout=args.timeout,
        op_timeout=args.op_timeout,
    )
    model = make_model(args)
    worker = Worker(args, gang, model, torch.optim.SGD(model.parameters(), lr=args.lr))
    await worker.adopt("joined" if gang.epoch > 0 else "formed", started)
    while worker.step < args.steps:
        began = time.monotonic()
        if worker.step == args.die_at_step:
            emit("killed", step=worker.step, rank=worker.gang.rank, at=time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            # At a step boundary, agree on whether a replacement waits to join.
            if await agang.broadcast_flag(worker.gang, worker.gang.waiting_to_join() > 0):
                await worker.reform("admitted a joiner", began)
                continue
            loss = await worker.train_step()
        except agang.GangError as error:
            emit("failed", step=worker.step, error=type(error).__name__, at=time.monotonic())
            await worker.recover(time.monotonic())
            continue
        if worker.gang.rank == 0:
            emit("step", step=worker.step, epoch=worker.gang.epoch, loss=loss)
        worker.step += 1
        await anyio.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    emit("done", step=worker.step, epoch=worker.gang.epoch, rank=worker.gang.rank)
    await worker.gang.close()
    return 0


# -- the script: starts the store and the workers, and tells what happened --------------


class Output:
    """A process's stdout, line by line, read on a thread so that every wait is bounded."""

    def __init__(self, name: str, stream: IO[str] | None) -> None:
        assert stream is not None
        self.name = name
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)


@dataclass
class Job:
    """The processes this script started (ended by pid at exit) and what they said."""

    args: argparse.Namespace
    started: list[subprocess.Popen[str]] = field(default_factory=list)
    workers: dict[int, subprocess.Popen[str]] = field(default_factory=dict)  # by pid
    events: queue.Queue[tuple[int, dict[str, Any] | None]] = field(default_factory=queue.Queue)
    logs: dict[int, list[str]] = field(default_factory=dict)
    port: int = 0

    def start_store(self) -> None:
        """``agang store`` on 127.0.0.1, a free port: waits (bounded) for where it listens."""
        process = subprocess.Popen(
            [sys.executable, "-m", "agang", "store", "--host", HOST, "--port", "0", "--quiet"],
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )
        self.started.append(process)
        out = Output("store", process.stdout)
        try:
            first = out.lines.get(timeout=STORE_START_TIMEOUT)
        except queue.Empty:
            first = None
        if first is None or not first.startswith("agang store listening on "):
            raise RuntimeError(f"`agang store` did not start: its first line was {first!r}")
        self.port = int(first.rsplit(":", 1)[1])

    def start_worker(self, index: int, die_at_step: int | None) -> subprocess.Popen[str]:
        """A worker process: ``RANK`` ``index`` orders formation 0; a replacement waits
        in ``agang.init`` to be admitted at the next reform."""
        args = self.args
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(index)]
        for name in ("workers", "steps", "min_size", "batch", "hidden", "lr", "step_seconds"):
            command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        command += ["--op-timeout", str(args.op_timeout), "--timeout", str(args.timeout)]
        command += ["--seed", str(args.seed)]
        if die_at_step is not None:
            command += ["--die-at-step", str(die_at_step)]
        env = worker_env(
            MASTER_ADDR=HOST,
            MASTER_PORT=str(self.port),
            RANK=str(index),
            WORLD_SIZE=str(args.workers),
            LOCAL_RANK=str(index),
        )
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.started.append(process)
        self.workers[process.pid] = process
        self.logs[process.pid] = []
        threading.Thread(target=self._read_events, args=(process,), daemon=True).start()
        threading.Thread(target=self._read_log, args=(process,), daemon=True).start()
        return process

    def _read_events(self, process: subprocess.Popen[str]) -> None:
        """A worker's stdout: its events; the end of it means the worker exited."""
        assert process.stdout is not None
        try:
            for line in process.stdout:
                if line.startswith(EVENT):
                    self.events.put((process.pid, json.loads(line[len(EVENT) :])))
                else:
                    self._log(process.pid, line)
        finally:
            self.events.put((process.pid, None))

    def _read_log(self, process: subprocess.Popen[str]) -> None:
        """A worker's stderr: kept for the report if it fails (shown with --verbose)."""
        assert process.stderr is not None
        for line in process.stderr:
            self._log(process.pid, line)

    def _log(self, pid: int, line: str) -> None:
        self.logs[pid].append(line.rstrip("\n"))
        if self.args.verbose:
            print(f"[pid {pid}] {line.rstrip()}", file=sys.stderr, flush=True)

    def stop_all(self) -> list[int]:
        """Ends every process this script started, by pid: SIGTERM, then SIGKILL; their pids."""
        for process in self.started:
            if process.poll() is None:
                process.terminate()
        for process in self.started:
            try:
                process.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_GRACE)
        return [process.pid for process in self.started]


def worker_env(**extra: str) -> dict[str, str]:
    """This environment without another job's world, one CPU thread per process."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        and not name.startswith("TORCHELASTIC_")
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@dataclass
class Story:
    """What the workers reported, in order of arrival."""

    events: list[dict[str, Any]] = field(default_factory=list)
    exits: dict[int, int] = field(default_factory=dict)  # pid -> status

    def of(self, kind: str) -> Iterator[dict[str, Any]]:
        return (e for e in self.events if e["kind"] == kind)


def supervise(job: Job, story: Story, deadline: float) -> None:
    """Follows the run until every worker exited: starts the replacement once the
    survivors have reformed; stops at the first worker that fails."""
    args = job.args
    victim = job.start_worker(args.kill, args.at_step) if args.kill is not None else None
    for index in range(args.workers):
        if index != args.kill:
            job.start_worker(index, None)
    replacement: subprocess.Popen[str] | None = None
    while len(story.exits) < len(job.workers):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the run did not end within --timeout {args.timeout} s")
        try:
            pid, event = job.events.get(timeout=left)
        except queue.Empty:
            continue
        if event is None:
            story.exits[pid] = job.workers[pid].wait(STOP_GRACE)
            expected = -signal.SIGKILL if victim is not None and pid == victim.pid else 0
            if story.exits[pid] != expected:
                raise RuntimeError(worker_failed(job, pid, story.exits[pid]))
            if (
                replacement is not None
                and len(story.exits) == len(job.workers) - 1
                and replacement.pid not in story.exits
                and not any(e["pid"] == replacement.pid for e in story.of("epoch"))
            ):
                raise RuntimeError(
                    "training ended before the replacement was admitted: give more "
                    "--steps (or --step-seconds) after --at-step"
                )
            continue
        story.events.append(event)
        if args.respawn and replacement is None and event["kind"] == "epoch" and event["epoch"]:
            replacement = job.start_worker(args.kill, None)
            story.events.append({"kind": "respawned", "pid": replacement.pid})


def worker_failed(job: Job, pid: int, status: int) -> str:
    tail = "\n".join(f"    {line}" for line in job.logs[pid][-30:])
    return f"worker pid {pid} exited with status {status}; its last output:\n{tail}"


def timeline(story: Story) -> list[str]:
    """The run as rows: step, epoch, world size, and what happened then."""
    rows = [f"{'step':>5}  {'epoch':>5}  {'size':>4}  event"]
    losses = {e["step"]: e["loss"] for e in story.of("step")}
    killed = next(story.of("killed"), None)
    seen: set[int] = set()
    for event in story.events:
        if event["kind"] == "killed":
            rows.append(
                f"{event['step']:>5}  {'':>5}  {'':>4}  rank {event['rank']} "
                f"(pid {event['pid']}) SIGKILLed at the start of the step"
            )
        elif event["kind"] == "respawned":
            rows.append(f"{'':>5}  {'':>5}  {'':>4}  replacement started (pid {event['pid']})")
        elif event["kind"] == "epoch" and event["epoch"] not in seen:
            seen.add(event["epoch"])
            rows.append(epoch_row(story, event, killed))
    done = next(story.of("done"), None)
    if done is not None and losses:
        last = max(losses)
        rows.append(
            f"{done['step']:>5}  {done['epoch']:>5}  {'':>4}  done: loss {losses[min(losses)]:.4f} "
            f"at step {min(losses)}, {losses[last]:.4f} at step {last}"
        )
    return rows


def epoch_row(story: Story, event: dict[str, Any], killed: dict[str, Any] | None) -> str:
    """An epoch's row: how it came about, and its slowest member's time to get there."""
    members = [e for e in story.of("epoch") if e["epoch"] == event["epoch"]]
    ready_at = max(e["ready_at"] for e in members)
    head = f"{event['step']:>5}  {event['epoch']:>5}  {event['size']:>4}  "
    before = [e["size"] for e in story.of("epoch") if e["epoch"] == event["epoch"] - 1]
    if not before:
        return head + f"formed in {max(e['took'] for e in members):.2f} s"
    if event["size"] < before[0] and killed is not None:
        return head + f"the survivors reformed {ready_at - killed['at']:.2f} s after the SIGKILL"
    # The members' pause: from the step boundary (or a failed op) to rank 0's state.
    paused = max(e["took"] for e in members if e["cause"] != "joined")
    return head + f"a replacement joined at a step boundary (training paused {paused:.2f} s)"


def show_timeline(story: Story) -> None:
    for row in timeline(story):
        print(row, flush=True)


def run_job(args: argparse.Namespace) -> int:
    """The script's side: the store, the workers, the timeline; every process ended."""
    job, story = Job(args), Story()
    deadline = time.monotonic() + args.timeout
    try:
        job.start_store()
        plan = f"{args.workers} workers, {args.steps} steps, agang store on {HOST}:{job.port}"
        if args.kill is not None:
            plan += f"; rank {args.kill} dies at step {args.at_step}"
            plan += "; a replacement is started" if args.respawn else ""
        print(f"elastic trainer: {plan}", flush=True)
        began = time.monotonic()
        supervise(job, story, deadline)
        show_timeline(story)
        final = [e["loss"] for e in story.of("step") if e["step"] == args.steps - 1]
        if not final:
            raise RuntimeError(f"no worker reported step {args.steps - 1}")
        took = time.monotonic() - began
        print(f"final loss {final[-1]:.4f} after {args.steps} steps ({took:.1f} s)")
        return 0
    except RuntimeError as error:
        show_timeline(story)
        print(f"elastic trainer failed: {error}", file=sys.stderr)
        return 1
    finally:
        pids = job.stop_all()
        print(f"processes started and ended: {' '.join(map(str, pids))}", flush=True)


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the script still ends what it started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker is not None:
        import anyio

        return int(anyio.run(run_worker, args))
    stop_on_sigterm()
    try:
        return run_job(args)
    except KeyboardInterrupt:
        print("elastic trainer: interrupted; its processes were ended", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
