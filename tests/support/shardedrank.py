"""One rank of a sharded trainer or of a sharded server, a process of its own, for
``tests/gloo/test_weights_sharded_server_faults.py``: the test starts each rank, kills
the ones it means to by pid, and reads what each says as JSON lines on its stdout.

``python shardedrank.py ROLE RANK SIZE PORT STORE CHANNEL [--name NAME]`` joins, as
rank RANK of SIZE, a gang whose rendezvous store the test hosts on 127.0.0.1:PORT (as
torchrun's agent store), then:

- ``trainer``: opens a ``WeightPublisher`` over the gang with its shards of
  :func:`model` (``agang.Sharded`` along dimension 0, and a tensor held whole), prints
  ``opened``, and for each line ``VERSION`` on stdin writes its shards of that version
  and pushes it, printing ``pushed`` with the report (every rank gets the same); at
  the end of stdin it closes the channel.
- ``server``: opens a ``WeightSubscriber`` named NAME over the gang (a sharded
  server) with its slices (rows, columns, and tensors held whole), prints ``opened``,
  then calls ``receive`` until it raises, printing ``received`` per version (``exact``:
  every slice equals the version's), then ``failed`` (the error's type and message,
  and the seconds the failing ``receive`` took), then ``closed`` once ``close``
  returned (with its seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import torch
from netutil import rank_env

import agang
from agang import Sharded, WeightPublisher, WeightSubscriber

BUCKET_BYTES = 1024
#: Longer than any test waits: a ``receive`` that ends did so for its own reason.
RECEIVE_SECONDS = 300.0
PUSH_SECONDS = 20.0
#: The model's tensors: global shape, dtype, and the dimension each side splits (None:
#: held whole). The trainer splits rows; the server rows, columns, or nothing.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, int | None, int | None]] = {
    "rows": ((37, 16), torch.float32, 0, 0),  # more rows than a bucket holds
    "cols": ((24, 19), torch.float32, 0, 1),  # a server rank's columns: strided shares
    "bias": ((50,), torch.float64, 0, None),  # split on the trainer, whole on the server
    "steps": ((3,), torch.int64, None, None),  # whole on both
}


def model(version: int) -> dict[str, torch.Tensor]:
    """The whole model at ``version``: distinct per element, tensor and version."""
    out = {}
    for index, (name, (shape, dtype, _, _)) in enumerate(SHAPES.items()):
        count = 1
        for size in shape:
            count *= size
        values = torch.arange(count, dtype=torch.float64) + 1000 * index + 100_000 * version
        out[name] = values.to(dtype).reshape(shape)
    return out


def piece(whole: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    """``rank``'s part of ``whole`` split along ``dim`` as ``torch.chunk`` splits it."""
    if dim is None:
        return whole.clone()
    chunks = torch.chunk(whole, size, dim)
    if rank < len(chunks):
        return chunks[rank].contiguous()
    return whole.narrow(dim, 0, 0).contiguous()


def side(version: int, rank: int, size: int, trainer: bool) -> dict[str, Any]:
    """A rank's tensors at ``version``: its shards (``agang.Sharded``) and whole ones."""
    out: dict[str, Any] = {}
    for name, whole in model(version).items():
        _, _, on_trainer, on_server = SHAPES[name]
        dim = on_trainer if trainer else on_server
        mine = piece(whole, dim, rank, size)
        out[name] = mine if dim is None else Sharded(mine, dim, tuple(whole.shape))
    return out


def local(tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.tensor if isinstance(v, Sharded) else v for k, v in tensors.items()}


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def read_line() -> str:
    """The next line of stdin ("" at its end), read off the loop."""
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def train(gang: agang.Gang, args: argparse.Namespace) -> None:
    tensors = side(0, gang.rank, gang.size, trainer=True)
    publisher = await WeightPublisher.open(
        tensors,
        store=args.store,
        channel=args.channel,
        timeout=PUSH_SECONDS,
        bucket_bytes=BUCKET_BYTES,
        gang=gang,
    )
    say(event="opened", pid=os.getpid(), rank=gang.rank, agang=agang.__file__)
    while line := (await read_line()).strip():
        version = int(line)
        for name, value in local(side(version, gang.rank, gang.size, trainer=True)).items():
            local(tensors)[name].copy_(value)
        report = await publisher.push(version)
        say(
            event="pushed",
            version=report.version,
            delivered=sorted(report.delivered),
            dropped=report.dropped,
            seconds=report.seconds,
        )
    await publisher.close()


async def serve(gang: agang.Gang, args: argparse.Namespace) -> None:
    tensors = side(0, gang.rank, gang.size, trainer=False)
    # Sharded slices: open takes them with gang= (its annotation says tensors alone).
    zeros: dict[str, Any] = {
        k: Sharded(torch.zeros_like(v.tensor), v.dim, v.shape)
        if isinstance(v, Sharded)
        else torch.zeros_like(v)
        for k, v in tensors.items()
    }
    subscriber = await WeightSubscriber.open(
        zeros, store=args.store, channel=args.channel, name=args.name, timeout=20, gang=gang
    )
    say(event="opened", pid=os.getpid(), rank=gang.rank, agang=agang.__file__)
    held = local(zeros)
    while True:
        began = time.monotonic()
        try:
            version = await subscriber.receive(timeout=RECEIVE_SECONDS)
        except Exception as error:  # the test judges what it says
            say(
                event="failed",
                error=type(error).__name__,
                message=str(error),
                seconds=time.monotonic() - began,
            )
            break
        expected = local(side(version, gang.rank, gang.size, trainer=False))
        exact = all(torch.equal(held[k], expected[k]) for k in held)
        say(event="received", version=version, exact=exact)
    began = time.monotonic()
    await subscriber.close()
    say(event="closed", seconds=time.monotonic() - began)


async def main(args: argparse.Namespace) -> None:
    env = rank_env(args.rank, args.port, args.size, agent_store=True)
    gang = await agang.init(backend="gloo", env=env, in_process=False, timeout=60, op_timeout=60)
    try:
        await (train(gang, args) if args.role == "trainer" else serve(gang, args))
    finally:
        await gang.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "server"])
    parser.add_argument("rank", type=int)
    parser.add_argument("size", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("store")
    parser.add_argument("channel")
    parser.add_argument("--name", default="sharded")
    asyncio.run(main(parser.parse_args()))
