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
from shardedtrainer import open_refused, push_versions, push_versions_sync, shapes, version_of

from agang import GangError, WeightSubscriber
from agang.testing import WorldRunError, run_world

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
    store: str, channel: str, versions: int, sync: bool = False, **options: Any
) -> tuple[list[Any], WeightSubscriber]:
    """The 2-rank FSDP2 trainer (a thread runs its world; ``sync``: the trainer has no
    event loop) and a whole server here."""
    zeros = {name: torch.zeros(shape) for name, shape in shapes().items()}
    pushing = functools.partial(
        push_versions_sync if sync else push_versions,
        store=store,
        channel=channel,
        versions=versions,
        servers=("whole",),
        **options,
    )
    run = functools.partial(run_world, pushing, 2, timeout=150, make_gang=not sync)
    results: list[Any] = []

    async def trainer() -> None:
        try:
            results.extend(await anyio.to_thread.run_sync(run))
        except WorldRunError as error:  # a rank failed (or was killed): the test judges
            results.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(trainer)
        server = await WeightSubscriber.open(zeros, store=store, channel=channel, name="whole")
    return results, server


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_an_fsdp2_trainer_on_two_ranks_delivers_exact_contents_to_a_whole_server(
    store: str, sync: bool
) -> None:
    """Pushed from an event loop, and from a program without one (``init_sync``,
    ``open_sync(gang=)``, ``push_sync``, ``close_sync``)."""
    results, server = await trainer_and_server(store, f"fsdp-{sync}", versions=2, sync=sync)
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


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_trainer_rank_killed_mid_push_fails_it_with_blame_and_no_server_takes_it(
    store: str,
) -> None:
    """Rank 1 is SIGKILLed as rank 0 gathers its shares of a version: rank 0's push
    raises, naming what was lost; the server keeps the last whole version."""
    results, server = await trainer_and_server(store, "fsdp-kill", versions=1, kill=True)
    try:
        (failed,) = results
        assert isinstance(failed, WorldRunError), results
        assert set(failed.failures) == {1}, failed  # killed, as the test meant
        what, said, last = failed.results[0]
        assert what == "raised", said
        assert f"version {last + 1} failed and no server took it" in said, said
        assert await server.receive(timeout=20) == last
        for name, value in whole(last).items():
            assert torch.equal(server._tensors[name], value), name
        # The lost push's version is never whole: no newer version, until the trainer's
        # exit (run_world ends rank 0 after rank 1's death) leaves the channel.
        with pytest.raises((TimeoutError, GangError)):
            await server.receive(timeout=1.0)
        assert server.version == last
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("what", "why"),
    [("partial", "cannot move a Partial placement"), ("2-d mesh", "on a 2-D mesh")],
)
def test_a_placement_one_rank_cannot_move_is_refused_on_every_rank(
    store: str, what: str, why: str
) -> None:
    said = run_world(
        functools.partial(
            open_refused, store=store, channel=f"refused-{what.replace(' ', '')}", what=what
        ),
        2,
        timeout=60,
    )
    for text in said:
        assert "Rank 1 of the gang" in text, text
        assert "`tensors['w']`" in text, text
        assert why in text, text
