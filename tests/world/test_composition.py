"""One gang implementation over three backends: what production and its fakes agree on.

A gang is ``CollectiveGang`` over a backend (c10d, FakeGang's, FakeWorld's), so the
numbering and the counters are the engine's on all of them. Making a lane or a sub-gang
is not an op: it takes no sequence number and counts as nothing issued, on c10d and on
the fakes alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import agang
from agang._collective.gang import CollectiveGang
from agang.testing import FakeWorld, FakeWorldGang, run_world


async def _numbering_around_children(gang: agang.Gang) -> dict[str, Any]:
    """seq and counters before and after a lane and a sub-gang, on the root and on them."""
    first = gang.all_reduce(torch.ones(1))
    await first
    lane = await gang.lane("side")
    pair = await gang.create_gang([0, 1])
    second = gang.all_reduce(torch.ones(1))
    await second
    on_lane = lane.barrier()
    await on_lane
    on_pair = None
    if pair is not None:
        handle = pair.all_reduce(torch.ones(1))
        await handle
        on_pair = (handle.seq, pair.statistics().num_issued)
    stats = gang.statistics()
    report = {
        "seqs": [first.seq, second.seq],
        "issued": stats.num_issued,
        "completed": stats.num_completed,
        "in_flight": stats.num_in_flight,
        "lane": (on_lane.seq, lane.statistics().num_issued),
        "pair": on_pair,
        "names": [lane.name.removeprefix(gang.name), None if pair is None else pair.name],
    }
    await gang.close()
    return report


def _expected(rank: int, root: str) -> dict[str, Any]:
    return {
        "seqs": [0, 1],
        "issued": 2,
        "completed": 2,
        "in_flight": 0,
        "lane": (0, 1),
        "pair": (0, 1) if rank in (0, 1) else None,
        "names": ["/lane:side", f"{root}[0, 1]" if rank in (0, 1) else None],
    }


@pytest.mark.anyio
async def test_fake_world_numbers_as_c10d_does_around_lanes_and_sub_gangs() -> None:
    world = FakeWorld(3)
    results = await world.run(_numbering_around_children)
    assert results == [_expected(rank, "fake-world") for rank in range(3)]


@pytest.mark.gloo
def test_c10d_numbers_around_lanes_and_sub_gangs() -> None:
    results = run_world(_numbering_around_children, 3, timeout=90)
    assert results == [_expected(rank, "root") for rank in range(3)]


@pytest.mark.anyio
async def test_fake_gang_numbers_alike() -> None:
    report = await _numbering_around_children(agang.FakeGang(rank=1, size=3))
    assert report == _expected(1, "fake")


@pytest.mark.anyio
async def test_fake_world_children_that_disagree_fail_on_every_rank() -> None:
    world = FakeWorld(2, op_timeout=5.0)

    async def program(gang: agang.Gang) -> str:
        ranks = [0, 1] if gang.rank == 0 else [1]
        try:
            await gang.create_gang(ranks)
        except agang.GangInitError as error:
            return str(error)
        return "made"

    errors = await world.run(program)
    assert all("different gangs" in error for error in errors), errors
    # Not an op: the root gang is untouched and still usable.
    assert [g.statistics().num_issued for g in world.gangs] == [0, 0]
    assert await world.run(lambda g: g.all_reduce(torch.ones(1))) == [torch.full((1,), 2.0)] * 2


@pytest.mark.anyio
async def test_a_fake_world_child_that_a_peer_never_makes_fails_within_the_deadline() -> None:
    world = FakeWorld(2, op_timeout=0.2)
    with pytest.raises(agang.GangInitError, match=r"did not finish within 0\.2 s"):
        await world[0].create_gang([0, 1])
    assert not world[0].closed


def test_every_gang_is_the_one_implementation() -> None:
    for gang_class in (agang.ProcessGroupGang, agang.FakeGang, FakeWorldGang):
        assert issubclass(gang_class, CollectiveGang)
        # Gang -> CollectiveGang -> the public constructor: depth 3 at most.
        depth = len([c for c in gang_class.__mro__ if issubclass(c, agang.Gang)])
        assert depth <= 3, gang_class.__mro__


async def _group_is_freed_at_close(gang: agang.Gang) -> bool:
    import gc
    import weakref

    assert isinstance(gang, agang.ProcessGroupGang)
    await gang.all_reduce(torch.ones(1))
    group = weakref.ref(gang.process_group)
    await gang.close()
    gc.collect()
    return group() is None


@pytest.mark.gloo
def test_close_frees_the_process_group_while_the_gang_lives_on() -> None:
    """Nothing of the gang keeps its group alive past close: the group (and the store
    its world holds, with its port) goes then, not whenever the gang object does."""
    assert run_world(_group_is_freed_at_close, 2, timeout=60) == [True, True]
