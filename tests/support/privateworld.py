"""A member of a private world (``agang._setup.private_world``), for
``tests/gloo/test_private_world.py``: forms the gang, says so, then all-reduces its
rank + 1 and then 1, printing one JSON line per event; a second formation in the
process is refused first. With ``--idle`` it takes part
in the first all-reduce only. Run: ``python privateworld.py STORE RANK SIZE LOOP
[--idle]``."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch
import torch.distributed as dist

from agang._membership.member import Member
from agang._setup import private_world


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def form(store: str, rank: int, size: int) -> Any:
    return await private_world.form(
        store=store,
        rank=rank,
        size=size,
        namespace="agang/ray/private",
        name="private",
        timeout=60,
        op_timeout=60,
        elastic=None,
        device=None,
    )


async def main(store: str, rank: int, size: int, idle: bool, mismatch: bool) -> None:
    gang = await form(store, rank, size)
    say("joined", rank=gang.rank, where=Member.here(), default_group=dist.is_initialized())
    try:
        await form(store, rank, size)
    except Exception as error:  # one world gang per process: refused before anything
        say("refused", message=str(error))
    if mismatch:  # rank 0 all-reduces while the others broadcast: order checks say so
        tensor = torch.ones(4)
        try:
            if rank == 0:
                await gang.all_reduce(tensor)
            else:
                await gang.broadcast(tensor, 0)
        except Exception as error:
            say("failed", kind=type(error).__name__, message=str(error))
        await gang.close()
        return
    tensor = torch.full((4,), float(rank + 1))
    try:
        await gang.all_reduce(tensor)
        say("result", value=tensor.tolist())
        if idle:
            await anyio.sleep(120)
            return
        tensor.fill_(1.0)
        await gang.all_reduce(tensor)  # the second waits on a member that may be idle
        say("result", value=tensor.tolist())
    except Exception as error:
        say("failed", message=str(error), at=time.time())
    await gang.close()


if __name__ == "__main__":
    store, rank, size, loop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    idle, mismatch = "--idle" in sys.argv, "--mismatch" in sys.argv
    backend, options = (
        ("trio", {}) if loop == "trio" else ("asyncio", {"use_uvloop": loop == "uvloop"})
    )
    anyio.run(main, store, rank, size, idle, mismatch, backend=backend, backend_options=options)
    os._exit(0)
