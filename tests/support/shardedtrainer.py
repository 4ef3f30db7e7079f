"""A sharded trainer for the weights tests (``tests/gloo/test_weights_fsdp.py``): an
FSDP2 model (``fully_shard`` of each layer, then the root, on the gang's ranks), whose
parameters are set at each version to ``version_of(name, shape, version)``, pushed by
every rank over the gang. Run by ``agang.testing.run_world`` (a module-level function,
importable by name in the ranks); ``push_versions_sync`` is the same trainer in a program
without an event loop (the sync twins)."""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

import anyio
import torch

import agang
from agang import Gang, WeightPublisher

#: The model: an FSDP2 root over three layers; "out" has more rows than the buckets hold.
IN, HIDDEN, OUT = 33, 65, 257
BUCKET_BYTES = 4096


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT, bias=True)
    )


def shapes() -> dict[str, tuple[int, ...]]:
    """The state_dict's names and global shapes (as the servers hold them)."""
    return {name: tuple(value.shape) for name, value in model().state_dict().items()}


def version_of(index: int, shape: tuple[int, ...], version: int) -> torch.Tensor:
    """Tensor ``index``'s whole value at ``version``: distinct per element and version."""
    count = math.prod(shape)
    return (torch.arange(count, dtype=torch.float32) + 1e4 * index + 1e6 * version).reshape(shape)


def _sharded_model(gang: Gang) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (gang.size,))
    made = model()
    for layer in (made[0], made[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(made, mesh=mesh)
    return made, mesh


def _set(state: dict[str, Any], rank: int, size: int, version: int) -> None:
    """Each DTensor's local shard takes its rows of the version's whole value."""
    with torch.no_grad():
        for index, (_, value) in enumerate(state.items()):
            whole = version_of(index, tuple(value.shape), version)
            local = value.to_local()
            chunks = torch.chunk(whole, size, 0)
            if rank < len(chunks):
                local.copy_(chunks[rank])


async def push_versions(
    gang: Gang,
    store: str,
    channel: str,
    versions: int,
    servers: tuple[str, ...],
    kill: bool = False,
) -> list[Any]:
    """Opens a publisher over ``gang`` for the FSDP2 model's ``state_dict()``, waits
    until a push reaches every server of ``servers``, then pushes ``versions`` more.
    With ``kill``, rank 1 kills itself (SIGKILL) as the first of those begins: rank 0's
    push must raise; it returns ``["raised", what it said, the last version pushed]``."""
    made, _ = _sharded_model(gang)
    state = made.state_dict()
    publisher = await WeightPublisher.open(
        state, store=store, channel=channel, timeout=20, bucket_bytes=BUCKET_BYTES, gang=gang
    )
    version = 0
    give_up_at = time.monotonic() + 30.0
    while True:  # the servers open beside the trainer: push until each is in
        version += 1
        _set(state, gang.rank, gang.size, version)
        report = await publisher.push(version)
        if set(servers) <= set(report.delivered) or time.monotonic() > give_up_at:
            break
        await anyio.sleep(0.1)
    reports = [report]
    for _ in range(versions):
        version += 1
        _set(state, gang.rank, gang.size, version)
        if kill:
            if gang.rank == 1:
                await anyio.sleep(0.05)  # rank 0 is gathering: it waits for these shares
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                await publisher.push(version, timeout=10)
            except Exception as error:  # the test reads what it said
                return ["raised", f"{type(error).__name__}: {error}", reports[-1].version]
            return ["pushed", version]
        reports.append(await publisher.push(version))
    await publisher.close()
    return reports


def push_versions_sync(
    store: str, channel: str, versions: int, servers: tuple[str, ...]
) -> list[Any]:
    """``push_versions`` without an event loop: ``agang.init_sync``, then the publisher's
    sync twins over the gang (``run_world(..., make_gang=False)``)."""
    gang = agang.init_sync()
    made, _ = _sharded_model(gang)
    state = made.state_dict()
    publisher = WeightPublisher.open_sync(
        state, store=store, channel=channel, timeout=20, bucket_bytes=BUCKET_BYTES, gang=gang
    )
    version = 0
    give_up_at = time.monotonic() + 30.0
    while True:  # the servers open beside the trainer: push until each is in
        version += 1
        _set(state, gang.rank, gang.size, version)
        report = publisher.push_sync(version)
        if set(servers) <= set(report.delivered) or time.monotonic() > give_up_at:
            break
        time.sleep(0.1)
    reports = [report]
    for _ in range(versions):
        version += 1
        _set(state, gang.rank, gang.size, version)
        reports.append(publisher.push_sync(version))
    publisher.close_sync()
    gang.close_sync()
    return reports


async def open_refused(gang: Gang, store: str, channel: str, what: str) -> str:
    """Opens a publisher where rank 1 alone holds a tensor agang cannot move (``what``:
    "partial", or "2-d mesh"); returns what this rank's ``open`` raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (gang.size,))
    square = init_device_mesh("cpu", (1, gang.size), mesh_dim_names=("a", "b"))  # collective
    tensors: dict[str, Any] = {"ok": DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])}
    if gang.rank == 1:
        if what == "partial":
            tensors["w"] = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        else:
            tensors["w"] = DTensor.from_local(torch.ones(4), square, [Shard(0), Shard(0)])
    else:
        tensors["w"] = DTensor.from_local(torch.ones(4), mesh, [Shard(0)])
    try:
        await WeightPublisher.open(tensors, store=store, channel=channel, timeout=20, gang=gang)
    except ValueError as error:
        return str(error)
    return "opened"
