"""Weights to a changing fleet: a trainer pushes to two HTTP inference servers, one dies.

One command runs the whole demo on 127.0.0.1 (``pip install -e '.[web]'`` first)::

    python examples/weight_sync.py --kill --respawn

It starts an ``agang store``, a trainer and two inference servers (``s0``, ``s1``), all
processes of its own that it ends by pid however it exits, and polls both servers
while the weights change under them. ``--kill`` SIGKILLs ``s1`` as push ``--kill-at``
begins; ``--respawn`` then starts a new ``s1``, which opens again under the same name,
is admitted at a later push and serves the newest version. At the end it prints a
timeline (each push: version, delivered, dropped and why, seconds; the kill, the
respawn, the joins) and the versions each server served as the client saw them, and
exits 0 only if the checks hold: every server served versions that never went back,
the killed server was reported dropped with why, and every live server (the respawned
one too) served the last version. Every wait is bounded (``--timeout`` bounds the run).

How it works:

- The trainer trains a small MLP on a synthetic regression task (``y = sin(3x)``, CPU)
  and every ``--every`` steps awaits ``publisher.push(step)`` on the model's
  ``state_dict()`` (an ``agang.WeightPublisher``); it prints each push's report. A push
  never raises for a lost server: the report's ``dropped`` names it and says why.
- Each server (an ``agang.WeightSubscriber`` and a starlette app that uvicorn serves on
  the same event loop) answers ``GET /predict?x=0.5`` with the model's output and the
  version it serves, and ``GET /health``. A background task awaits
  ``subscriber.receive()``, which copies each new version into the subscriber's own
  tensors (``incoming``) on a worker thread while the loop goes on serving; so requests
  never read those tensors. Once ``receive`` returns, the task copies ``incoming`` into a
  new model and swaps it in with the version, in one step of the loop: a request reads
  the old pair or the new one, never half a version.
- Pushes admit new servers at their start (membership changes at round boundaries), so
  a respawned server joins at the push after it opened, and receives it in full.
- The kill is aimed at a push: the trainer announces push ``--kill-at`` and starts it
  once the script has SIGKILLed ``s1`` (a push of this small model takes milliseconds,
  too short to aim a kill inside). That push finds ``s1`` gone, drops it within its
  deadline (``--push-timeout``) plus a bounded recovery, and delivers to the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

HOST = "127.0.0.1"  # the store, the servers and the client use loopback only
CHANNEL = "policy"
NAMES = ("s0", "s1")  # the servers; s1 is the one --kill kills
VICTIM = "s1"
PROBE = 0.5  # the x the client asks the servers about
EVENT = "EVENT "  # the children's stdout lines that start so are events for the script
STOP_GRACE = 5.0  # seconds a child gets to exit after SIGTERM, before SIGKILL
SETTLE = 10.0  # seconds the client may take to see the last version on every server


# -- arguments ------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked: every error names the parameter (status 2)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--every", type=int, default=20, help="push every K training steps")
    parser.add_argument(
        "--pushes",
        type=int,
        default=10,
        help="the fewest pushes; with --respawn the trainer goes on until the new s1 is in",
    )
    parser.add_argument("--kill", action="store_true", help="SIGKILL server s1 mid-run")
    parser.add_argument("--kill-at", type=int, default=4, help="the push s1 is killed at")
    parser.add_argument(
        "--respawn", action="store_true", help="start a new s1 once the old one is killed"
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0.02,
        help="the least time a training step takes (a pause after a fast one)",
    )
    parser.add_argument("--hidden", type=int, default=32, help="width of the MLP")
    parser.add_argument("--lr", type=float, default=0.05, help="Adam's learning rate")
    parser.add_argument("--push-timeout", type=float, default=2.0, help="each push's deadline")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between client polls")
    parser.add_argument("--timeout", type=float, default=90.0, help="bound on the whole run")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    # A child's own arguments: set by the script when it starts one.
    parser.add_argument("--role", default="demo", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    problem = check(args)
    if problem is not None:
        parser.error(problem)
    return args


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with ``args`` (naming the parameter), or None."""
    if args.role not in ("demo", "trainer", "server"):
        return f"--role must be demo, trainer or server, but is {args.role!r}"
    for name in ("every", "pushes", "kill_at", "hidden"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, but is {getattr(args, name)}"
    for name in ("lr", "push_timeout", "poll", "timeout"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, but is {getattr(args, name)}"
    if not args.step_seconds >= 0:
        return f"--step-seconds must be at least 0, but is {args.step_seconds}"
    if args.respawn and not args.kill:
        return "--respawn replaces the killed server: it needs --kill"
    if args.kill and args.kill_at >= args.pushes:
        return f"--kill-at ({args.kill_at}) must be below --pushes ({args.pushes})"
    return None


# -- what the children share -------------------------------------------------------------


def emit(kind: str, **fields: Any) -> None:
    """Tells the script something (one line on stdout)."""
    line = EVENT + json.dumps({"kind": kind, "pid": os.getpid(), **fields}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: whole even on a shared pipe


def make_model(hidden: int) -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(1, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, 1),
    )


def target(x: float) -> float:
    """What the model learns: y = sin(3x)."""
    return math.sin(3 * x)


# -- the trainer ---------------------------------------------------------------------------


def read_commands(loop: asyncio.AbstractEventLoop) -> asyncio.Queue[str]:
    """The script's commands on stdin, one a line ("" at the end), read on a daemon thread."""
    commands: asyncio.Queue[str] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "")

    threading.Thread(target=read, daemon=True).start()
    return commands


async def run_trainer(args: argparse.Namespace) -> int:
    """Trains, pushes every ``--every`` steps, and ends after the push that follows the
    script's "finish" (or stdin's end). Before push ``--kill-at`` (with ``--kill``) it
    waits, bounded, for the script's "go" (the kill is done)."""
    import torch

    import agang

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    commands = read_commands(asyncio.get_running_loop())
    model = make_model(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed)
    # state_dict() holds the parameters' own storage: each push sends their values then.
    publisher = await agang.WeightPublisher.open(
        model.state_dict(), store=args.store, channel=CHANNEL, timeout=30.0
    )
    emit("opened", channel=CHANNEL, bytes=publisher.plan.nbytes)
    if await asyncio.wait_for(commands.get(), args.timeout) != "go":
        await publisher.close()
        return 1
    finishing = False
    pushes = 0
    step = 0
    try:
        for step in range(1, 1_000_000):
            began = time.monotonic()
            x = torch.rand(64, 1, generator=data) * 2 - 1
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(3 * x))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.every == 0:
                pushes += 1
                while not commands.empty():
                    finishing = finishing or commands.get_nowait() in ("finish", "")
                emit("pushing", version=step, push=pushes, final=finishing)
                if args.kill and pushes == args.kill_at:
                    await asyncio.wait_for(commands.get(), 30.0)  # "go": s1 is dead
                report = await publisher.push(step, timeout=args.push_timeout)
                emit(
                    "pushed",
                    version=report.version,
                    push=pushes,
                    delivered=list(report.delivered),
                    dropped=report.dropped,
                    seconds=report.seconds,
                    loss=loss.item(),
                    final=finishing,
                )
                if finishing:
                    break
            await asyncio.sleep(max(0.0, args.step_seconds - (time.monotonic() - began)))
    finally:
        await publisher.close()  # the servers' receive then says the channel closed
    emit("done", version=step)
    return 0


# -- an inference server -------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: SIGTERM is the server process's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_http(app: Starlette, port: int) -> AsyncIterator[int]:
    """Serves ``app`` on HOST:``port`` (0: a free port) on this event loop, within the
    block; yields the port."""
    sock = socket.create_server((HOST, port))  # a taken port raises here, at once
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        http="h11",  # named: no look for other HTTP or WebSocket stacks at start
        ws="none",
        proxy_headers=False,
        timeout_graceful_shutdown=2,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):  # up to 5 s for the app to be served
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # its error, if it failed to start
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True  # uvicorn looks every 0.1 s, then closes its connections
        await asyncio.wait({task}, timeout=5.0)
        if not task.done():
            task.cancel()
        sock.close()


@dataclass
class Served:
    """What a server answers with: a model and its version, swapped together."""

    model: Any = None
    version: int | None = None
    # Then "subscribed", "serving", and at the end "done" (the channel closed) or
    # "orphaned" (it was lost).
    status: str = "starting"


async def run_server(args: argparse.Namespace) -> int:
    """Serves HTTP at once; subscribes; takes each new version between requests."""
    served = Served()

    async def health(request: Request) -> JSONResponse:
        body = {"name": args.name, "status": served.status, "version": served.version}
        return JSONResponse(body)

    async def predict(request: Request) -> JSONResponse:
        try:
            x = float(request.query_params["x"])
        except (KeyError, ValueError):
            return JSONResponse({"error": "usage: /predict?x=<float>"}, status_code=400)
        model, version = served.model, served.version  # one pair, whatever comes meanwhile
        if model is None:
            return JSONResponse({"error": "no version yet", "name": args.name}, status_code=503)
        torch = sys.modules["torch"]  # imported by now (an import here would wait for it)
        with torch.inference_mode():
            y = float(model(torch.tensor([[x]])).item())
        return JSONResponse({"name": args.name, "version": version, "x": x, "y": y})

    app = Starlette(routes=[Route("/health", health), Route("/predict", predict)])
    stop = asyncio.Event()
    main = asyncio.current_task()
    assert main is not None

    def on_signal() -> None:
        stop.set()
        if served.status == "starting":  # importing torch, or in open: nothing to leave
            main.cancel()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    async with serve_http(app, 0) as port:
        emit("listening", name=args.name, port=port)
        # torch takes seconds to import: off the loop, so /health answers meanwhile.
        torch = await asyncio.to_thread(importlib.import_module, "torch")
        agang = await asyncio.to_thread(importlib.import_module, "agang")
        torch.set_num_threads(1)
        incoming = make_model(args.hidden)  # receive() writes these; requests never read them
        subscriber = await agang.WeightSubscriber.open(
            incoming.state_dict(), store=args.store, channel=CHANNEL, name=args.name, timeout=30.0
        )
        served.status = "subscribed"
        emit("opened", name=subscriber.name)

        async def take_versions() -> None:
            while True:
                try:
                    version = await subscriber.receive(timeout=5.0)
                except TimeoutError:
                    continue  # no push for a while: wait on
                except agang.GangClosedError:  # the trainer closed the channel: the end
                    served.status = "done"
                    emit("closed", name=args.name)
                    return
                except agang.GangError as error:  # the trainer died, or the store went away
                    served.status = "orphaned"
                    emit("orphaned", name=args.name, why=str(error))
                    return
                fresh = copy.deepcopy(incoming)  # on the loop: no request runs meanwhile
                served.model, served.version, served.status = fresh, version, "serving"
                emit("took", name=args.name, version=version)

        taker = asyncio.create_task(take_versions())
        try:
            await stop.wait()  # the script's SIGTERM
        finally:
            taker.cancel()
            await asyncio.wait({taker}, timeout=5.0)
            await asyncio.wait_for(subscriber.close(), 15.0)
    return 0


# -- the script: the store, the children, the client, the timeline --------------------------


@dataclass
class Child:
    """A process the script started: its label ("s1+" for the respawned s1) and output."""

    label: str
    process: asyncio.subprocess.Process
    log: list[str] = field(default_factory=list)
    port: int | None = None
    opened: bool = False
    killed_at: float | None = None


def child_env() -> dict[str, str]:
    """This environment without another job's world, one CPU thread per process."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        and not name.startswith("TORCHELASTIC_")
    }
    return {**env, "OMP_NUM_THREADS": "1"}


def get_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=5.0) as reply:
        body: dict[str, Any] = json.loads(reply.read())
        return body


def shown(label: str) -> str:
    """A child's name in the report: the respawned s1 ("s1+") is "s1 (respawned)"."""
    return label.replace("+", " (respawned)")


def clip(text: str, most: int = 150) -> str:
    """``text``'s first line, cut to ``most`` characters (a why can hold a whole error)."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= most else line[: most - 3] + "..."


@dataclass
class Demo:
    """The run: the processes it started (ended by pid), what they said, what the client saw."""

    args: argparse.Namespace
    began: float = field(default_factory=time.monotonic)
    children: list[Child] = field(default_factory=list)
    events: asyncio.Queue[tuple[Child, dict[str, Any] | None]] = field(
        default_factory=asyncio.Queue
    )
    rows: list[tuple[float, str]] = field(default_factory=list)  # the timeline
    pushes: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)  # t, v, y
    errors: dict[str, list[str]] = field(default_factory=dict)  # once serving
    store: str = ""
    final: int | None = None  # the trainer's last version, once it is done
    finishing: bool = False  # the trainer was told to finish
    interrupted: bool = False  # SIGTERM: stop following, end the children
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # the output readers

    def now(self) -> float:
        return time.monotonic() - self.began

    def note(self, text: str) -> None:
        self.rows.append((self.now(), clip(text)))

    def child(self, label: str) -> Child | None:
        return next((c for c in self.children if c.label == label), None)

    def servers(self, *, live: bool = False) -> list[Child]:
        """The servers started (the respawned s1 is "s1+"), or the ones not killed."""
        found = [c for c in self.children if c.label.rstrip("+") in NAMES]
        return [c for c in found if c.killed_at is None] if live else found

    # The children.

    async def spawn(self, label: str, *arguments: str) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            *arguments,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=child_env(),
        )
        child = Child(label, process)
        self.children.append(child)
        return child

    def follow(self, child: Child) -> None:
        """Reads a child's stdout (its events; the end: it exited) and stderr (its log)."""

        async def events() -> None:
            assert child.process.stdout is not None
            async for raw in child.process.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith(EVENT):
                    await self.events.put((child, json.loads(line[len(EVENT) :])))
                else:
                    self.log(child, line)
            await self.events.put((child, None))

        async def log() -> None:
            assert child.process.stderr is not None
            async for raw in child.process.stderr:
                self.log(child, raw.decode(errors="replace").rstrip("\n"))

        for reader in (events(), log()):
            task = asyncio.create_task(reader)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def log(self, child: Child, line: str) -> None:
        child.log.append(line)
        if self.args.verbose:
            print(f"[{child.label} pid {child.process.pid}] {line}", file=sys.stderr, flush=True)

    async def start_store(self) -> None:
        """``agang store`` on 127.0.0.1, a free port: waits (bounded) for where it listens."""
        child = await self.spawn(
            "store", "-m", "agang", "store", "--host", HOST, "--port", "0", "--quiet"
        )
        assert child.process.stdout is not None
        first = await asyncio.wait_for(child.process.stdout.readline(), 30.0)
        line = first.decode().strip()
        if not line.startswith("agang store listening on "):
            raise RuntimeError(f"`agang store` did not start: its first line was {line!r}")
        self.store = line.rsplit(" ", 1)[1]
        self.follow(child)
        self.note(f"agang store listening on {self.store} (pid {child.process.pid})")

    async def start_server(self, name: str, label: str) -> Child:
        child = await self.spawn(label, *self.role("server"), "--name", name)
        self.follow(child)
        return child

    def role(self, role: str) -> list[str]:
        args = self.args
        return [
            str(Path(__file__).resolve()),
            *("--role", role, "--store", self.store, "--hidden", str(args.hidden)),
            *("--every", str(args.every), "--pushes", str(args.pushes)),
            *("--kill-at", str(args.kill_at), "--step-seconds", str(args.step_seconds)),
            *("--lr", str(args.lr), "--push-timeout", str(args.push_timeout)),
            *("--timeout", str(args.timeout), "--seed", str(args.seed)),
            *(["--kill"] if args.kill else []),
        ]

    async def tell(self, child: Child, command: str) -> None:
        assert child.process.stdin is not None
        child.process.stdin.write(f"{command}\n".encode())
        await child.process.stdin.drain()

    async def stop_all(self) -> list[int]:
        """Ends every child by pid: the servers, the trainer, then the store; SIGTERM,
        then SIGKILL after STOP_GRACE seconds. Returns their pids."""

        async def stop(child: Child) -> None:
            process = child.process
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), STOP_GRACE)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGKILL)
                    await asyncio.wait_for(process.wait(), STOP_GRACE)

        last = [c for c in self.children if c.label == "store"]
        await asyncio.gather(*(stop(c) for c in self.children if c not in last))
        await asyncio.gather(*(stop(c) for c in last))
        for task in list(self.tasks):
            task.cancel()
        return [c.process.pid for c in self.children]

    # The client.

    async def poll(self) -> None:
        """GET /predict on every live server, every ``--poll`` seconds: a loop per server,
        so that a slow one (a respawned one still importing torch) delays no other."""
        loops: dict[str, asyncio.Task[None]] = {}

        async def poll_one(child: Child) -> None:
            while child.killed_at is None:
                await self.ask(child)
                await asyncio.sleep(self.args.poll)

        try:
            while True:
                for child in self.servers(live=True):
                    if child.port is not None and child.label not in loops:
                        loops[child.label] = asyncio.create_task(poll_one(child))
                await asyncio.sleep(self.args.poll)
        finally:
            for task in loops.values():
                task.cancel()
            if loops:
                await asyncio.wait(loops.values(), timeout=5.0)

    async def ask(self, child: Child) -> None:
        """One request. A server counts as serving from its first answer with a version:
        before, it is starting (importing torch, subscribing), and a request that fails
        or is late is no error, as a load balancer would not route to it yet."""
        assert child.port is not None
        try:
            body = await asyncio.to_thread(get_json, child.port, f"/predict?x={PROBE}")
        except OSError as error:  # HTTPError (503: no version yet) too, and timeouts
            if child.killed_at is None and child.label in self.seen:  # the kill's are none
                self.errors.setdefault(child.label, []).append(f"{self.now():.2f} s: {error}")
            return
        self.seen.setdefault(child.label, []).append(
            (self.now(), int(body["version"]), float(body["y"]))
        )

    def last_seen(self, label: str) -> int | None:
        seen = self.seen.get(label)
        return seen[-1][1] if seen else None

    # The run.

    async def run(self) -> None:
        args = self.args
        deadline = time.monotonic() + args.timeout
        await self.start_store()
        trainer = await self.spawn("trainer", *self.role("trainer"))
        self.follow(trainer)
        for name in NAMES:
            await self.start_server(name, name)
        await self.until(
            lambda: trainer.opened and all(c.opened for c in self.children if c.label in NAMES),
            deadline,
            "the trainer and both servers opened",
        )
        client = asyncio.create_task(self.poll())
        try:
            await self.tell(trainer, "go")
            self.note("trainer: go")
            await self.until(lambda: self.final is not None, deadline, "the trainer's last push")
            live = self.servers(live=True)
            settle = min(deadline, time.monotonic() + SETTLE)
            await self.until(
                lambda: all(self.last_seen(c.label) == self.final for c in live),
                settle,
                f"every live server serving version {self.final}",
            )
        finally:
            client.cancel()
            await asyncio.wait({client}, timeout=5.0)

    async def until(self, done: Any, deadline: float, what: str) -> None:
        """Handles the children's events until ``done()``, at most until ``deadline``."""
        while not done():
            if self.interrupted:  # also when wait_for swallowed the cancel (Python 3.11)
                raise asyncio.CancelledError
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out waiting for {what}")
            try:
                child, event = await asyncio.wait_for(self.events.get(), min(left, 0.1))
            except TimeoutError:
                continue
            await self.handle(child, event)

    async def handle(self, child: Child, event: dict[str, Any] | None) -> None:
        args = self.args
        label = child.label
        if event is None:  # the child's stdout ended: it exited
            status = await asyncio.wait_for(child.process.wait(), STOP_GRACE)
            if child.killed_at is None and not (label == "trainer" and status == 0):
                tail = "\n".join(f"    {line}" for line in child.log[-30:])
                raise RuntimeError(
                    f"{shown(label)} exited with status {status}; its last output:\n{tail}"
                )
            return
        kind = event["kind"]
        if kind == "listening":
            child.port = event["port"]
            self.note(f"{shown(label)} serves HTTP on {HOST}:{child.port} (pid {event['pid']})")
        elif kind == "opened":
            child.opened = True
            what = "opened" if label == "trainer" else "subscribed to"
            self.note(f"{shown(label)} {what} channel '{CHANNEL}'")
        elif kind == "pushing" and args.kill and event["push"] == args.kill_at:
            victim = self.child(VICTIM)
            assert victim is not None
            victim.killed_at = self.now()
            os.kill(victim.process.pid, signal.SIGKILL)
            await asyncio.wait_for(victim.process.wait(), STOP_GRACE)
            self.note(
                f"{VICTIM} SIGKILLed (pid {victim.process.pid}) as push v{event['version']} begins"
            )
            await self.tell(self.trainer(), "go")
            if args.respawn:
                again = await self.start_server(VICTIM, VICTIM + "+")
                self.note(f"{VICTIM} respawned under its name (pid {again.process.pid})")
        elif kind == "pushed":
            await self.on_pushed(event)
        elif kind == "done":
            self.final = event["version"]
            self.note(f"trainer done: last version v{self.final}; it closed the channel")
        elif kind == "orphaned":
            self.note(f"{shown(label)}: {event['why']}")

    def trainer(self) -> Child:
        found = self.child("trainer")
        assert found is not None
        return found

    async def on_pushed(self, event: dict[str, Any]) -> None:
        args = self.args
        before = set(self.pushes[-1]["delivered"]) if self.pushes else set()
        self.pushes.append(event)
        delivered = event["delivered"]
        joined = sorted(set(delivered) - before)
        dropped = event["dropped"]
        text = (
            f"push v{event['version']:<4} {event['seconds']:6.3f} s  loss {event['loss']:.4f}"
            f"  delivered {' '.join(delivered) or '-'}"
        )
        if joined:
            text += f"  (joined: {' '.join(joined)})"
        for name, why in dropped.items():
            text += f"\n{'':>9}dropped {name}: {clip(why)}"
        self.rows.append((self.now(), text))
        if self.final is None and not self.finishing and len(self.pushes) >= args.pushes:
            respawned = self.child(VICTIM + "+")
            back = respawned is not None and any(
                VICTIM in p["delivered"] for p in self.pushes[args.kill_at :]
            )
            if not args.respawn or back:
                self.finishing = True
                await self.tell(self.trainer(), "finish")

    # The report.

    def timeline(self) -> list[str]:
        rows = [f"{'t (s)':>7}  event"]
        rows += [f"{t:7.2f}  {text}" for t, text in sorted(self.rows, key=lambda r: r[0])]
        rows.append("served, as the client saw it (GET /predict?x=0.5; version: answers):")
        for child in self.servers():
            seen = self.seen.get(child.label)
            name = shown(child.label)
            if not seen:
                rows.append(f"  {name}: nothing")
                continue
            counts: dict[int, int] = {}
            for _, version, _ in seen:
                counts[version] = counts.get(version, 0) + 1
            versions = " ".join(f"v{v}:{n}" for v, n in counts.items())
            y = seen[-1][2]
            tail = " (killed)" if child.killed_at is not None else ""
            rows.append(f"  {name}: {versions}; last y={y:.3f} (target {target(PROBE):.3f}){tail}")
        return rows

    def problems(self) -> list[str]:
        """The checks that fail (none: the run did what it should)."""
        args = self.args
        found = []
        for label, seen in self.seen.items():
            versions = [v for _, v, _ in seen]
            if versions != sorted(versions):
                found.append(f"{shown(label)} served versions out of order: {versions}")
        for label, errors in self.errors.items():
            found.append(f"{shown(label)}: {len(errors)} request(s) failed: {errors[:3]}")
        if not any(len({v for _, v, _ in seen}) > 1 for seen in self.seen.values()):
            found.append("no server was seen changing version while it served")
        live = self.servers(live=True)
        for child in live:
            if self.last_seen(child.label) != self.final:
                found.append(
                    f"{child.label} last served {self.last_seen(child.label)}, "
                    f"not the last version {self.final}"
                )
        if self.pushes and sorted(self.pushes[-1]["delivered"]) != sorted(
            c.label.rstrip("+") for c in live
        ):
            found.append(f"the last push delivered to {self.pushes[-1]['delivered']} only")
        if args.kill:
            kill_push = self.pushes[args.kill_at - 1] if len(self.pushes) >= args.kill_at else {}
            if VICTIM not in kill_push.get("dropped", {}):
                found.append(f"push {args.kill_at} did not report {VICTIM} dropped: {kill_push}")
        if args.respawn and self.last_seen(VICTIM + "+") != self.final:
            found.append(f"the respawned {VICTIM} did not serve the last version {self.final}")
        return found


async def run_demo(args: argparse.Namespace) -> int:
    """The script's side: every child started and ended here, by pid."""
    demo = Demo(args)
    plan = f"trainer + servers {' '.join(NAMES)}, a push every {args.every} steps"
    if args.kill:
        plan += f"; {VICTIM} SIGKILLed at push {args.kill_at}"
        plan += ", then respawned" if args.respawn else ""
    print(f"weight sync: {plan}", flush=True)
    failure: str | None = None
    main = asyncio.current_task()
    assert main is not None

    def on_sigterm() -> None:
        demo.interrupted = True
        main.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await demo.run()
    except (RuntimeError, TimeoutError) as error:
        failure = str(error) or type(error).__name__
    finally:
        pids = await demo.stop_all()
    for row in demo.timeline():
        print(row)
    print(f"processes started and ended: {' '.join(map(str, pids))}")
    problems = ([failure] if failure else []) + demo.problems()
    took = demo.now()
    if problems:
        for problem in problems:
            print(f"check failed: {problem}", file=sys.stderr)
        print(f"weight sync failed after {took:.1f} s", flush=True)
        return 1
    print(f"weight sync ok: every check held ({took:.1f} s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs = {"demo": run_demo, "trainer": run_trainer, "server": run_server}
    try:
        return asyncio.run(runs[args.role](args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"weight sync ({args.role}): interrupted; its processes were ended", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
