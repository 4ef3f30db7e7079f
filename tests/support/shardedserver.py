"""A sharded server for the weights tests (``tests/gloo/test_weights_tp_servers.py``):
every rank of its gang holds its slices of ``tests/support/shardedtrainer.py``'s model as
DTensors on its own mesh (rows, columns, and a tensor held whole), subscribes with
``gang=``, and checks each version it receives against the whole value. Run by
``agang.testing.run_world`` (a module-level function, importable by name in the ranks)."""

from __future__ import annotations

from typing import Any

import torch
from shardedtrainer import shapes, version_of

from agang import Gang, WeightSubscriber


async def serve_sharded(gang: Gang, store: str, channel: str) -> dict[str, Any]:
    """Receives until the channel closes (or nothing comes for 20 s); returns what this
    rank took: each version, whether its slices were exact, and its staging's bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (gang.size,))
    placements = [Shard(0), Replicate(), Shard(1), Shard(0)]  # rows, whole, columns, rows
    state = {
        name: distribute_tensor(torch.zeros(shape), mesh, [placements[index % 4]])
        for index, (name, shape) in enumerate(shapes().items())
    }
    subscriber = await WeightSubscriber.open(
        state, store=store, channel=channel, name="sharded", timeout=20, gang=gang
    )
    taken: list[tuple[int, bool]] = []
    ended = ""
    try:
        while True:
            version = await subscriber.receive(timeout=20)
            exact = all(
                torch.equal(
                    value.to_local(),
                    _slice(version_of(index, tuple(value.shape), version), value, gang),
                )
                for index, value in enumerate(state.values())
            )
            taken.append((version, exact))
    except Exception as error:  # the channel closed, or the test judges what it says
        ended = f"{type(error).__name__}: {error}"
    staged = subscriber.staging_bytes
    await subscriber.close()
    local = sum(v.to_local().numel() * 4 for v in state.values())
    return {"taken": taken, "ended": ended, "staging": staged, "slice": local}


def _slice(whole: torch.Tensor, value: Any, gang: Gang) -> torch.Tensor:
    """``gang.rank``'s part of ``whole`` under ``value``'s placement (torch.chunk's)."""
    placement = value.placements[0]
    if not placement.is_shard():
        return whole
    chunks = torch.chunk(whole, gang.size, placement.dim)
    return chunks[gang.rank] if gang.rank < len(chunks) else whole.narrow(placement.dim, 0, 0)
