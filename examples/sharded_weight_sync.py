"""Weights from a sharded trainer: an FSDP2 trainer under torchrun pushes to servers.

One command runs the whole demo on 127.0.0.1::

    python examples/sharded_weight_sync.py --trainer-ranks 2 --server-ranks 2

It starts an ``agang store``, a trainer of ``--trainer-ranks`` ranks under ``torchrun``,
a whole-tensor server (``whole``) and, with ``--server-ranks`` above 1, a sharded server
(``sharded``) of that many ranks under ``torchrun``: all processes of its own, that it
ends by pid however it exits. At the end it prints each push (version, delivered,
seconds) and each server's versions, and exits 0 only if the checks hold: every version
a server took holds exactly the trainer's weights of that version (a checksum of every
tensor, the trainer's taken over the whole model with ``full_tensor()``, the sharded
server's over its ranks' slices), and every server took the last one. Every wait is
bounded (``--timeout``).

How it works:

- Each trainer rank (``--role trainer``, under ``torchrun --standalone``) joins the
  gang (``agang.init``), shards a small MLP with FSDP2 (``fully_shard`` of each layer
  and the root, on a 1-D mesh of the gang), and trains it on ``y = sin(3x)``. Every
  rank opens one ``agang.WeightPublisher`` over the gang on the model's
  ``state_dict()`` (DTensors, each rank holding its rows) and every ``--every`` steps
  awaits ``publisher.push(version)`` together: rank 0 gathers each bucket of the
  weights from the ranks' shards while the bucket before moves to the servers, so no
  rank ever holds the whole model; every rank gets the same report.
- The whole server (``--role server``) opens an ``agang.WeightSubscriber`` on whole
  tensors of the model's global shapes and takes each version with ``receive()``.
- The sharded server (``--role sharded``, under ``torchrun``) is a tensor-parallel-like
  server: each rank holds its slice of every weight (rows of the first layers, columns
  of the last one, as ``DTensor``s on its own mesh) and every rank opens one
  ``WeightSubscriber`` over its gang. Its rank 0 is the channel's member and relays
  each bucket's slices to the others; each rank stages only its slice; ``receive()`` is
  collective and returns a version every rank holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

CHANNEL = "policy"
HOST = "127.0.0.1"
EVENT = "@event "
STOP_GRACE = 5.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--trainer-ranks", type=int, default=2, help="ranks of the trainer")
    parser.add_argument(
        "--server-ranks", type=int, default=1, help="ranks of the server (1: whole tensors)"
    )
    parser.add_argument("--pushes", type=int, default=5, help="pushes after the first")
    parser.add_argument("--every", type=int, default=10, help="push every K training steps")
    parser.add_argument("--hidden", type=int, default=256, help="width of the MLP")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on the whole run")
    parser.add_argument("--verbose", action="store_true", help="show the children's output")
    parser.add_argument("--role", default="demo", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("trainer_ranks", "pushes", "every", "hidden"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.server_ranks < 1:
        parser.error("--server-ranks must be at least 1")
    return args


def emit(kind: str, **fields: Any) -> None:
    print(EVENT + json.dumps({"kind": kind, **fields}), flush=True)


def make_model(hidden: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(), torch.nn.Linear(hidden, 1),
    )  # fmt: skip


def checksum(tensors: dict[str, Any]) -> float:
    """A sum over every tensor, each weighted by its place: equal for equal bytes."""
    return float(sum((i + 1) * t.double().sum().item() for i, t in enumerate(tensors.values())))


# -- the trainer's ranks ------------------------------------------------------------------


async def run_trainer(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import agang

    gang = await agang.init()
    mesh = init_device_mesh("cpu", (gang.size,))
    model = make_model(args.hidden)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = model.state_dict()  # DTensors: this rank's rows of each weight
    publisher = await agang.WeightPublisher.open(
        state, store=args.store, channel=CHANNEL, timeout=30.0, gang=gang
    )
    generator = torch.Generator().manual_seed(gang.rank)
    version, pushed = 0, 0
    expected = {"whole", *(["sharded"] if args.server_ranks > 1 else [])}
    give_up_at = time.monotonic() + args.timeout / 2
    while pushed <= args.pushes:
        for _ in range(args.every):
            x = torch.rand(64, 1, generator=generator) * 2 - 1
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(3 * x))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        version += 1
        report = await publisher.push(version)
        whole = {name: value.full_tensor() for name, value in state.items()}  # collective
        if gang.rank == 0:
            emit(
                "push", version=version, delivered=list(report.delivered),
                seconds=report.seconds, loss=loss.item(), checksum=checksum(whole),
            )  # fmt: skip
        if pushed or expected <= set(report.delivered) or time.monotonic() > give_up_at:
            pushed += 1  # counting from the first push every server took
    await publisher.close()
    await gang.close()
    return 0


# -- a server -----------------------------------------------------------------------------


async def run_server(args: argparse.Namespace) -> int:
    import torch

    import agang

    tensors = {k: torch.zeros_like(v) for k, v in make_model(args.hidden).state_dict().items()}
    subscriber = await agang.WeightSubscriber.open(
        tensors, store=args.store, channel=CHANNEL, name="whole", timeout=30.0
    )
    try:
        while True:
            try:
                version = await subscriber.receive(timeout=args.timeout)
            except agang.GangClosedError:
                return 0  # the trainer closed the channel: the demo's end
            emit("took", server="whole", version=version, checksum=checksum(tensors))
    finally:
        await subscriber.close()


async def run_sharded(args: argparse.Namespace) -> int:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import agang

    gang = await agang.init()
    mesh = init_device_mesh("cpu", (gang.size,))
    shapes = {k: v.shape for k, v in make_model(args.hidden).state_dict().items()}
    last = list(shapes)[-2]  # the last layer's weight: columns; the others rows
    state = {
        name: distribute_tensor(torch.zeros(shape), mesh, [Shard(1 if name == last else 0)])
        for name, shape in shapes.items()
    }
    subscriber = await agang.WeightSubscriber.open(
        state, store=args.store, channel=CHANNEL, name="sharded", timeout=30.0, gang=gang
    )
    try:
        while True:
            try:
                version = await subscriber.receive(timeout=args.timeout)
            except agang.GangClosedError:
                return 0
            whole = {name: value.full_tensor() for name, value in state.items()}  # collective
            if gang.rank == 0:
                emit("took", server="sharded", version=version, checksum=checksum(whole))
    finally:
        await subscriber.close()
        await gang.close()


# -- the demo: the store, the children, the checks -----------------------------------------


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[tuple[str, asyncio.subprocess.Process]] = []
        self.events: list[dict[str, Any]] = []
        self.began = time.monotonic()

    async def spawn(self, label: str, *arguments: str) -> asyncio.subprocess.Process:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = await asyncio.create_subprocess_exec(
            sys.executable, *arguments, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.children.append((label, process))
        return process

    async def read(self, label: str, process: asyncio.subprocess.Process) -> None:
        async def events() -> None:
            assert process.stdout is not None
            async for raw in process.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.startswith(EVENT):
                    self.events.append(json.loads(line[len(EVENT) :]))
                elif self.args.verbose:
                    print(f"[{label}] {line}", file=sys.stderr, flush=True)

        async def log() -> None:
            assert process.stderr is not None
            async for raw in process.stderr:
                if self.args.verbose:
                    print(f"[{label}] {raw.decode(errors='replace').rstrip()}", file=sys.stderr)

        await asyncio.gather(events(), log())

    async def start_store(self) -> str:
        store = await self.spawn("store", "-m", "agang", "store", "--host", HOST, "--port", "0")
        assert store.stdout is not None
        line = (await asyncio.wait_for(store.stdout.readline(), 30.0)).decode().strip()
        if not line.startswith("agang store listening on "):
            raise RuntimeError(f"`agang store` did not start: its first line was {line!r}")
        return line.rsplit(" ", 1)[1]

    def role(self, role: str, store: str) -> list[str]:
        args = self.args
        return [
            str(Path(__file__).resolve()),
            *("--role", role, "--store", store, "--hidden", str(args.hidden)),
            *("--every", str(args.every), "--pushes", str(args.pushes)),
            *("--timeout", str(args.timeout), "--trainer-ranks", str(args.trainer_ranks)),
            *("--server-ranks", str(args.server_ranks)),
        ]

    async def run(self) -> int:
        args = self.args
        store = await self.start_store()
        print(f"agang store listening on {store}", flush=True)
        torchrun = ["-m", "torch.distributed.run", "--standalone"]
        trainer = await self.spawn(
            "trainer", *torchrun, f"--nproc-per-node={args.trainer_ranks}",
            *self.role("trainer", store),
        )  # fmt: skip
        servers = [await self.spawn("whole", *self.role("server", store))]
        if args.server_ranks > 1:
            ranks = f"--nproc-per-node={args.server_ranks}"
            sharded = self.role("sharded", store)
            servers.append(await self.spawn("sharded", *torchrun, ranks, *sharded))
        readers = [
            asyncio.create_task(self.read(label, process))
            for label, process in self.children
            if label != "store"
        ]
        codes = await asyncio.gather(trainer.wait(), *(s.wait() for s in servers))
        await asyncio.gather(*readers)
        return self.report(codes)

    def report(self, codes: list[int]) -> int:
        pushes = [e for e in self.events if e["kind"] == "push"]
        print(f"\n{'version':>8} {'ms':>8} {'loss':>8}  delivered")
        for push in pushes:
            print(
                f"{push['version']:>8} {push['seconds'] * 1e3:>8.1f} {push['loss']:>8.4f}  "
                f"{', '.join(push['delivered']) or '-'}"
            )
        expected = {p["version"]: p["checksum"] for p in pushes}
        failures = []
        if any(codes):
            failures.append(f"a child failed (exit codes: trainer, then servers: {codes})")
        names = ["whole", *(["sharded"] if self.args.server_ranks > 1 else [])]
        for name in names:
            took = [e for e in self.events if e["kind"] == "took" and e["server"] == name]
            versions = ", ".join(f"v{e['version']}" for e in took)
            print(f"{name} took: {versions or 'nothing'}")
            wrong = [
                e["version"]
                for e in took
                if not math.isclose(
                    e["checksum"], expected.get(e["version"], math.nan), rel_tol=1e-9
                )
            ]
            if wrong:
                failures.append(f"{name}: versions held other bytes than the trainer's: {wrong}")
            if not pushes or not took or took[-1]["version"] != pushes[-1]["version"]:
                failures.append(f"{name} did not take the last version")
        for failure in failures:
            print(f"CHECK FAILED: {failure}")
        if failures:
            return 1
        print("sharded weight sync ok: every check held")
        return 0

    async def stop_all(self) -> None:
        async def stop(process: asyncio.subprocess.Process) -> None:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), STOP_GRACE)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, signal.SIGKILL)
                    await process.wait()

        await asyncio.gather(*(stop(p) for label, p in self.children if label != "store"))
        await asyncio.gather(*(stop(p) for label, p in self.children if label == "store"))
        pids = " ".join(str(p.pid) for _, p in self.children)
        print(f"processes started and ended: {pids}", flush=True)


async def demo(args: argparse.Namespace) -> int:
    run = Demo(args)
    try:
        return await asyncio.wait_for(run.run(), args.timeout)
    except TimeoutError:
        print(f"CHECK FAILED: the demo did not end within {args.timeout:g} s")
        return 1
    finally:
        await run.stop_all()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "trainer":
        return asyncio.run(run_trainer(args))
    if args.role == "server":
        return asyncio.run(run_server(args))
    if args.role == "sharded":
        return asyncio.run(run_sharded(args))
    return asyncio.run(demo(args))


if __name__ == "__main__":
    sys.exit(main())
