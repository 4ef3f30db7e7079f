"""Sharded servers over real processes and Gloo: the FSDP2 trainer on 2 ranks
(``tests/support/shardedtrainer.py``), a whole server here and a 2-rank sharded server
(``tests/support/shardedserver.py``: DTensors on its own mesh) on one channel, exact on
every rank. The round protocol's cases in one process:
``tests/world/test_weights_sharded_servers.py``."""

from __future__ import annotations

import functools
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
from shardedserver import serve_sharded_sync
from shardedtrainer import BUCKET_BYTES, push_versions, shapes, version_of

from agang import WeightSubscriber
from agang.testing import run_world

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(240)]


@pytest.fixture
def store(module_store: str) -> str:
    return module_store


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_fsdp2_trainer_delivers_exact_slices_to_a_sharded_server_beside_a_whole_one(
    store: str,
) -> None:
    channel = "sharded-servers"
    trainer = functools.partial(
        run_world,
        functools.partial(
            push_versions, store=store, channel=channel, versions=2, servers=("whole", "sharded")
        ),
        2,
        timeout=200,
    )
    # The server has no event loop (the sync twins over a gang); the fault tests'
    # sharded servers await (``tests/gloo/test_weights_sharded_server_faults.py``).
    serving = functools.partial(serve_sharded_sync, store=store, channel=channel)
    server = functools.partial(run_world, serving, 2, timeout=200, make_gang=False)
    results: dict[str, list[Any]] = {}

    async def run(name: str, fn: Any) -> None:
        results[name] = await anyio.to_thread.run_sync(fn)

    zeros = {name: torch.zeros(shape) for name, shape in shapes().items()}
    model = sum(t.numel() * t.element_size() for t in zeros.values())
    async with anyio.create_task_group() as group:
        group.start_soon(run, "trainer", trainer)
        whole = await WeightSubscriber.open(zeros, store=store, channel=channel, name="whole")
        group.start_soon(run, "server", server)
    try:
        reports = results["trainer"]
        last = reports[0][-1]
        assert reports[0] == reports[1]
        assert sorted(last.delivered) == ["sharded", "whole"], last
        assert await whole.receive(timeout=20) == last.version
        for index, (name, shape) in enumerate(shapes().items()):
            assert torch.equal(whole._tensors[name], version_of(index, shape, last.version))
        for rank, took in enumerate(results["server"]):
            assert took["taken"], (rank, took)
            assert took["taken"][-1] == (last.version, True), (rank, took)
            assert all(exact for _, exact in took["taken"]), (rank, took)
            assert took["ended"].startswith("GangClosedError"), (rank, took)
            # Each rank stages its slice alone; rank 0 also the relay's buffers (bucket
            # 0, a ring of two buckets, a scratch one for the columns): less than the model.
            extra = 0 if rank else 4 * BUCKET_BYTES
            assert took["slice"] <= took["staging"] <= took["slice"] + extra, (rank, took)
            assert took["staging"] < model, (rank, took)
        assert results["server"][0]["taken"] == results["server"][1]["taken"]
    finally:
        await whole.close()
