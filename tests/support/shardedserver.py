"""A sharded server for the weights tests (``tests/gloo/test_weights_tp_servers.py``):
every rank of its gang holds its slices of ``tests/support/shardedtrainer.py``'s model as
DTensors on its own mesh (rows, columns, and a tensor held whole), subscribes with
``gang=``, and checks each version it receives against the whole value. Run by
``agang.testing.run_world`` (a module-level function, importable by name in the ranks),
with no event loop: the sync twins over a gang."""

from __future__ import annotations

from typing import Any

import torch
from shardedtrainer import shapes, version_of

import agang
from agang import Gang, WeightSubscriber


def serve_sharded_sync(store: str, channel: str) -> dict[str, Any]:
    """Receives until the channel closes (or nothing comes for 20 s), in a program
    without an event loop (``agang.init_sync``, then the subscriber's sync twins over
    the gang; ``run_world(..., make_gang=False)``); returns what this rank took: each
    version, whether its slices were exact, and its staging's bytes."""
    gang = agang.init_sync()
    state = _state(gang)
    subscriber = WeightSubscriber.open_sync(
        state, store=store, channel=channel, name="sharded", timeout=20, gang=gang
    )
    taken: list[tuple[int, bool]] = []
    ended = ""
    try:
        while True:
            version = subscriber.receive_sync(timeout=20)
            taken.append((version, _exact(state, version, gang)))
    except Exception as error:  # the channel closed, or the test judges what it says
        ended = f"{type(error).__name__}: {error}"
    staged = subscriber.staging_bytes
    subscriber.close_sync()
    gang.close_sync()
    return _took(state, taken, ended, staged)


def _state(gang: Gang) -> dict[str, Any]:
    """The server's DTensors: rows, whole, columns, rows, in turn."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (gang.size,))
    placements = [Shard(0), Replicate(), Shard(1), Shard(0)]
    return {
        name: distribute_tensor(torch.zeros(shape), mesh, [placements[index % 4]])
        for index, (name, shape) in enumerate(shapes().items())
    }


def _exact(state: dict[str, Any], version: int, gang: Gang) -> bool:
    """Whether every slice holds ``version``'s part."""
    return all(
        torch.equal(
            value.to_local(), _slice(version_of(index, tuple(value.shape), version), value, gang)
        )
        for index, value in enumerate(state.values())
    )


def _took(state: dict[str, Any], taken: Any, ended: str, staged: int) -> dict[str, Any]:
    local = sum(v.to_local().numel() * 4 for v in state.values())
    return {"taken": taken, "ended": ended, "staging": staged, "slice": local}


def _slice(whole: torch.Tensor, value: Any, gang: Gang) -> torch.Tensor:
    """``gang.rank``'s part of ``whole`` under ``value``'s placement (torch.chunk's)."""
    placement = value.placements[0]
    if not placement.is_shard():
        return whole
    chunks = torch.chunk(whole, gang.size, placement.dim)
    return chunks[gang.rank] if gang.rank < len(chunks) else whole.narrow(placement.dim, 0, 0)
