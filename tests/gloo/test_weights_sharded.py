"""A sharded trainer's pushes over real processes and Gloo: an FSDP2 model on a
2-rank trainer gang (``tests/support/shardedtrainer.py``) pushing to whole servers,
exact on every byte; a trainer rank killed mid-push; inputs refused on every rank.
The round protocol's cases in one process: ``tests/world/test_weights_sharded.py``."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from shardedtrainer import push_versions, shapes, version_of

from agang import WeightSubscriber
from agang.testing import run_world

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(180)]


@pytest.fixture
def store(module_store: str) -> str:
    return module_store


def whole(version: int) -> dict[str, torch.Tensor]:
    return {
        name: version_of(index, shape, version)
        for index, (name, shape) in enumerate(shapes().items())
    }


async def trainer_and_server(
    store: str, channel: str, versions: int, **options: Any
) -> tuple[list[Any], WeightSubscriber]:
    """The 2-rank FSDP2 trainer (a thread runs its world) and a whole server here."""
    zeros = {name: torch.zeros(shape) for name, shape in shapes().items()}
    run = functools.partial(
        run_world,
        functools.partial(
            push_versions,
            store=store,
            channel=channel,
            versions=versions,
            servers=("whole",),
            **options,
        ),
        2,
        timeout=150,
    )
    results: list[Any] = []

    async def trainer() -> None:
        results.extend(await anyio.to_thread.run_sync(run))

    async with anyio.create_task_group() as group:
        group.start_soon(trainer)
        server = await WeightSubscriber.open(zeros, store=store, channel=channel, name="whole")
    return results, server


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_fsdp2_trainer_on_two_ranks_delivers_exact_contents_to_a_whole_server(
    store: str,
) -> None:
    results, server = await trainer_and_server(store, "fsdp", versions=2)
    try:
        ranks = [[(r.version, r.delivered) for r in reports] for reports in results]
        assert ranks[0] == ranks[1]  # the same reports on both ranks
        last = results[0][-1]
        assert last.delivered == ("whole",), last
        assert await server.receive(timeout=20) == last.version
        for name, value in whole(last.version).items():
            assert torch.equal(server._tensors[name], value), name
    finally:
        await server.close()
