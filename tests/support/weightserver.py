"""A weights subscriber (or publisher) process for ``tests/gloo/test_weights*.py``.

``python weightserver.py serve STORE CHANNEL NAME [--b-rows N] [--big N] [--in-place]``
opens a ``WeightSubscriber`` and prints one JSON line per event: ``opened`` (with its
pid), then ``received`` per version (``exact``: the tensors equal ``model(version)``),
then ``failed`` (the error's type and message) when receive raises. With
``--on-stdin`` it first prints ``ready`` and opens only once a line comes on stdin, and
after a failure it opens again (same name) at the next line, until stdin ends: a
process started ahead of its time, or a server that reopens.
``python weightserver.py fork STORE CHANNEL`` imports what a server needs, prints
``ready``, and for each NAME read from stdin forks a server of that name (printing
``forked`` with its pid), whose events follow on the same stdout; it reaps the ones
that end (printing ``reaped``): servers by the dozen without a torch import each.
``python weightserver.py publish STORE CHANNEL [--big N] [--on-stdin]`` opens a
``WeightPublisher`` (with ``--on-stdin``, at the first line), prints ``opened``, and
pushes the versions read from stdin (``VERSION [TIMEOUT]``, one a line), printing
``pushed`` with the report's delivered, dropped and seconds.
"""

from __future__ import annotations

import os
import sys
import time

# ``--clock-skew S`` (before anything reads the clock): this process's wall clock runs
# S seconds off the others' (negative: behind), as on a host whose clock was never set.
if "--clock-skew" in sys.argv:
    _SKEW = float(sys.argv[sys.argv.index("--clock-skew") + 1])
    _wall = time.time
    time.time = lambda: _wall() + _SKEW

import argparse
import asyncio
import contextlib
import json
import select

import torch

import agang
from agang._weights.publisher import WeightPublisher
from agang._weights.subscriber import WeightSubscriber

SMALL = 1000  # elements of the small tensors


def model(version: int, *, b_rows: int = 4, big: int = 64 * 1024) -> dict[str, torch.Tensor]:
    """The weights of ``version``: a few small tensors of several dtypes and a big one,
    each a function of the version and the position."""
    return {
        "a": torch.arange(SMALL, dtype=torch.float32) + version,
        "b": torch.full((b_rows, 3), float(version), dtype=torch.float64),
        "steps": torch.tensor([version], dtype=torch.int64),
        "mask": torch.arange(7) % (version % 3 + 1) == 0,
        "big": torch.arange(big, dtype=torch.float32) * 0.5 - version,
    }


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def serve(args: argparse.Namespace) -> None:
    if not args.on_stdin:
        await serve_once(args)
        return
    say(event="ready", pid=os.getpid())
    while await read_line():
        await serve_once(args)


def fork(args: argparse.Namespace) -> None:
    """Forks a server per name read from stdin (no thread runs here: fork is safe)."""
    say(event="ready", pid=os.getpid())
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        with contextlib.suppress(ChildProcessError):
            while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                say(event="reaped", pid=ended[0], status=ended[1])
        if not readable:
            continue
        read = os.read(0, 4096)
        if not read:
            return
        *names, pending = (pending + read).split(b"\n")
        for name in names:
            fork_one(args, name.decode().strip())


def fork_one(args: argparse.Namespace, name: str) -> None:
    pid = os.fork()
    if pid == 0:
        args.name = name
        code = 1
        try:
            asyncio.run(serve_once(args))
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)
    say(event="forked", pid=pid, name=name)


async def read_line() -> str:
    """The next line of stdin ("" at its end), read off the loop."""
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def serve_once(args: argparse.Namespace) -> None:
    shapes = model(0, b_rows=args.b_rows, big=args.big)
    tensors = {k: torch.zeros_like(v, device=args.device) for k, v in shapes.items()}
    try:
        subscriber = await WeightSubscriber.open(
            tensors,
            store=args.store,
            channel=args.channel,
            name=args.name,
            timeout=args.timeout,
            in_place=args.in_place,
        )
    except (ValueError, agang.GangError) as error:
        say(event="refused", error=type(error).__name__, message=str(error))
        return
    say(event="opened", pid=os.getpid(), name=subscriber.name)
    for _ in range(10_000):
        try:
            version = await subscriber.receive(timeout=120)
        except (agang.GangError, TimeoutError) as error:
            say(event="failed", error=type(error).__name__, message=str(error))
            break
        expected = model(version, b_rows=args.b_rows, big=args.big)
        exact = all(torch.equal(tensors[k].cpu(), expected[k]) for k in tensors)
        say(event="received", version=version, exact=exact)
    await subscriber.close()


async def publish(args: argparse.Namespace) -> None:
    if args.on_stdin:  # started ahead: opens at the first line
        say(event="ready", pid=os.getpid())
        if not await read_line():
            return
    tensors = model(0, big=args.big)
    publisher = await WeightPublisher.open(
        tensors, store=args.store, channel=args.channel, timeout=args.timeout
    )
    say(event="opened", pid=os.getpid())
    for _ in range(10_000):
        line = await read_line()
        if not line:
            break
        version, *timeout = line.split()
        for name, value in model(int(version), big=args.big).items():
            tensors[name].copy_(value)
        report = await publisher.push(int(version), *map(float, timeout))
        say(
            event="pushed",
            version=report.version,
            delivered=list(report.delivered),
            dropped=report.dropped,
            seconds=report.seconds,
        )
    await publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "publish", "fork"])
    parser.add_argument("store")
    parser.add_argument("channel")
    parser.add_argument("name", nargs="?")
    parser.add_argument("--b-rows", type=int, default=4)
    parser.add_argument("--big", type=int, default=64 * 1024, help="elements of 'big'")
    parser.add_argument("--in-place", action="store_true")
    parser.add_argument("--device", default="cpu", help="where a server's tensors are")
    parser.add_argument("--on-stdin", action="store_true", help="open at each stdin line")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--clock-skew", type=float, default=0.0, help="seconds (read above)")
    args = parser.parse_args()
    if args.role == "fork":
        fork(args)
    else:
        asyncio.run(serve(args) if args.role == "serve" else publish(args))


if __name__ == "__main__":
    main()
