"""Parallel gangs: their layout, the current gangs of a task, and the helpers.

Membership is proven by collectives, not by reading attributes: every rank all-reduces
``2**root_rank`` over a gang, and the bits of the sum are the root ranks of its members.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import agang
from agang._parallel.layout import hybrid_groups, parallel_groups
from agang.testing import FakeWorld, run_world

pytestmark = pytest.mark.anyio

DIMENSIONS = ("root", "dp", "rdp", "sdp", "tp", "pp")

Groups = list[list[int]]


async def members(gang: agang.Gang, root_rank: int) -> list[int]:
    """The root ranks of ``gang``'s members, from a sum of one bit per member."""
    total = await gang.all_reduce(torch.tensor([2**root_rank], dtype=torch.int64))
    bits = int(total.item())
    return [rank for rank in range(bits.bit_length()) if bits >> rank & 1]


async def membership(gangs: agang.Gangs, root_rank: int) -> dict[str, tuple[list[int], int]]:
    """For every dimension: the members (as root ranks) and this rank's rank in it."""
    report = {}
    for name in DIMENSIONS:
        gang = getattr(gangs, name)
        report[name] = (await members(gang, root_rank), gang.rank)
    return report


def expected_membership(groups: dict[str, Groups], rank: int) -> dict[str, tuple[list[int], int]]:
    report = {}
    for name, dimension in groups.items():
        (group,) = [g for g in dimension if rank in g]
        report[name] = (group, group.index(rank))
    return report


def singletons(size: int) -> Groups:
    return [[rank] for rank in range(size)]


# The layouts as fairseq2 draws them (tensor-parallel neighbours adjacent, then data
# parallel, pipeline stages outermost), written out by hand.
LAYOUTS: list[tuple[int, dict[str, int], dict[str, Groups]]] = [
    (
        8,
        {"tp_size": 2, "pp_size": 2},
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        8,
        {"tp_size": 4},
        {
            "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "pp": singletons(8),
        },
    ),
    (
        8,
        {"pp_size": 2},
        {
            "tp": singletons(8),
            "dp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        },
    ),
    (
        12,
        {"tp_size": 2, "pp_size": 3},
        {
            "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]],
            "dp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]],
            "pp": [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]],
        },
    ),
    (4, {}, {"tp": singletons(4), "dp": [[0, 1, 2, 3]], "pp": singletons(4)}),
    (4, {"tp_size": 4}, {"tp": [[0, 1, 2, 3]], "dp": singletons(4), "pp": singletons(4)}),
]
LAYOUT_IDS = ["8-tp2-pp2", "8-tp4", "8-pp2", "12-tp2-pp3", "4-dp-only", "4-tp-only"]


@pytest.mark.parametrize(("world_size", "sizes", "groups"), LAYOUTS, ids=LAYOUT_IDS)
def test_parallel_groups_follow_the_layout(
    world_size: int, sizes: dict[str, int], groups: dict[str, Groups]
) -> None:
    layout = parallel_groups(
        world_size, tp_size=sizes.get("tp_size", 1), pp_size=sizes.get("pp_size", 1)
    )

    assert layout == groups


@pytest.mark.parametrize(("world_size", "tp_size", "pp_size"), [(24, 2, 3), (16, 4, 2), (6, 1, 6)])
def test_parallel_groups_partition_the_world_and_meet_in_one_rank(
    world_size: int, tp_size: int, pp_size: int
) -> None:
    layout = parallel_groups(world_size, tp_size=tp_size, pp_size=pp_size)

    for groups in layout.values():
        assert sorted(rank for group in groups for rank in group) == list(range(world_size))
    for rank in range(world_size):
        mine = [{*g} for groups in layout.values() for g in groups if rank in g]
        assert set.intersection(*mine) == {rank}


def test_hybrid_groups_split_each_node_and_join_positions() -> None:
    assert hybrid_groups(8, intra_node_size=4) == {
        "rdp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "sdp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    }


@pytest.mark.parametrize(("world_size", "sizes", "groups"), LAYOUTS, ids=LAYOUT_IDS)
async def test_create_parallel_gangs_on_a_fake_world(
    world_size: int, sizes: dict[str, int], groups: dict[str, Groups]
) -> None:
    async def program(root: agang.Gang) -> dict[str, tuple[list[int], int]]:
        gangs = await agang.create_parallel_gangs(root, **sizes)
        return await membership(gangs, root.rank)

    reports = await FakeWorld(world_size).run(program)

    everything = {"root": [list(range(world_size))], "rdp": singletons(world_size), **groups}
    everything["sdp"] = groups["dp"]
    for rank, report in enumerate(reports):
        assert report == expected_membership(everything, rank), f"rank {rank}"


async def test_size_1_dimensions_are_fakes_and_full_ones_are_the_root() -> None:
    async def program(root: agang.Gang) -> agang.Gangs:
        return await agang.create_parallel_gangs(root, tp_size=4)

    world = FakeWorld(4)
    for root, gangs in zip(world.gangs, await world.run(program), strict=True):
        assert gangs.root is root
        assert gangs.tp is root
        assert gangs.sdp is gangs.dp
        for name in ("dp", "rdp", "pp"):
            fake = getattr(gangs, name)
            assert isinstance(fake, agang.FakeGang), name
            assert (fake.rank, fake.size, fake.device) == (0, 1, root.device)
        assert len({id(gangs.dp), id(gangs.rdp), id(gangs.pp)}) == 3


async def test_a_fake_gang_root_simulates_one_rank_of_the_layout() -> None:
    gangs = await agang.create_parallel_gangs(agang.FakeGang(rank=5, size=8), tp_size=2, pp_size=2)

    # Rank 5 is at (pp 1, dp 0, tp 1): tp [4, 5], dp [5, 7], pp [1, 5].
    assert [(g.rank, g.size) for g in (gangs.tp, gangs.dp, gangs.pp)] == [(1, 2), (0, 2), (1, 2)]


# FSDP: (parallel sizes, intra_node_size, expected rdp and sdp groups as root ranks).
FSDP_LAYOUTS: list[tuple[dict[str, int], int | None, dict[str, Groups]]] = [
    ({}, 2, {"sdp": [[0, 1], [2, 3], [4, 5], [6, 7]], "rdp": [[0, 2, 4, 6], [1, 3, 5, 7]]}),
    ({}, 4, {"sdp": [[0, 1, 2, 3], [4, 5, 6, 7]], "rdp": [[0, 4], [1, 5], [2, 6], [3, 7]]}),
    # dp is a sub-gang ([0, 2, 4, 6] and [1, 3, 5, 7]): nodes are runs of its ranks.
    (
        {"tp_size": 2},
        2,
        {"sdp": [[0, 2], [4, 6], [1, 3], [5, 7]], "rdp": [[0, 4], [2, 6], [1, 5], [3, 7]]},
    ),
    ({}, None, {"sdp": [list(range(8))], "rdp": singletons(8)}),
    ({}, 8, {"sdp": [list(range(8))], "rdp": singletons(8)}),
    ({}, 1, {"sdp": singletons(8), "rdp": [list(range(8))]}),
]


@pytest.mark.parametrize(
    ("sizes", "intra_node_size", "groups"),
    FSDP_LAYOUTS,
    ids=["intra2", "intra4", "intra2-in-tp2", "none", "intra-all", "intra1"],
)
async def test_create_fsdp_gangs_on_a_fake_world(
    sizes: dict[str, int], intra_node_size: int | None, groups: dict[str, Groups]
) -> None:
    async def program(root: agang.Gang) -> tuple[dict[str, Any], agang.Gangs, agang.Gangs]:
        gangs = await agang.create_parallel_gangs(root, **sizes)
        fsdp = await agang.create_fsdp_gangs(gangs, intra_node_size)
        return await membership(fsdp, root.rank), gangs, fsdp

    for rank, (report, gangs, fsdp) in enumerate(await FakeWorld(8).run(program)):
        for name in ("sdp", "rdp"):
            assert report[name] == expected_membership(groups, rank)[name], (rank, name)
        for name in ("root", "dp", "tp", "pp"):
            assert getattr(fsdp, name) is getattr(gangs, name)


async def test_fsdp_without_intra_node_size_shards_over_dp() -> None:
    gangs = await agang.create_parallel_gangs(agang.FakeGang(rank=3, size=8))
    fsdp = await agang.create_fsdp_gangs(gangs)

    assert fsdp.sdp is gangs.dp
    assert isinstance(fsdp.rdp, agang.FakeGang)
    assert fsdp.rdp.size == 1


@pytest.mark.parametrize(
    ("sizes", "error", "message"),
    [
        ({"tp_size": 0}, ValueError, "`tp_size` must be a positive int, but is 0 instead."),
        ({"pp_size": -2}, ValueError, "`pp_size` must be a positive int, but is -2 instead."),
        ({"tp_size": 2.0}, ValueError, "`tp_size` must be a positive int, but is 2.0 instead."),
        ({"pp_size": True}, ValueError, "`pp_size` must be a positive int, but is True instead."),
        (
            {"tp_size": 3},
            ValueError,
            "`tp_size` must be a factor of `root.size` (8), but is 3 instead.",
        ),
        (
            {"tp_size": 2, "pp_size": 3},
            ValueError,
            "`pp_size` must be a factor of `root.size // tp_size` (4), but is 3 instead.",
        ),
        ({"pp_size": 16}, ValueError, "`pp_size` must be a factor"),
    ],
)
async def test_create_parallel_gangs_refuses_bad_sizes(
    sizes: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        await agang.create_parallel_gangs(agang.FakeGang(size=8), **sizes)

    assert message in str(info.value)


async def test_create_parallel_gangs_refuses_a_non_gang_and_a_closed_gang() -> None:
    with pytest.raises(TypeError, match=r"`root` must be an `agang.Gang`, but is of type `int`"):
        await agang.create_parallel_gangs(8)  # type: ignore[arg-type]

    root = agang.FakeGang(size=4)
    await root.close()
    with pytest.raises(agang.GangClosedError, match="`root` must be an open gang"):
        await agang.create_parallel_gangs(root, tp_size=2)


@pytest.mark.parametrize(
    ("intra_node_size", "error", "message"),
    [
        (0, ValueError, "`intra_node_size` must be a positive int, but is 0 instead."),
        ("2", ValueError, "`intra_node_size` must be a positive int, but is '2' instead."),
        (
            3,
            ValueError,
            "`intra_node_size` must be a factor of `gangs.dp.size` (8), but is 3 instead.",
        ),
        (16, ValueError, "`intra_node_size` must be a factor of `gangs.dp.size` (8)"),
    ],
)
async def test_create_fsdp_gangs_refuses_bad_sizes(
    intra_node_size: Any, error: type[Exception], message: str
) -> None:
    gangs = await agang.create_parallel_gangs(agang.FakeGang(size=8))

    with pytest.raises(error) as info:
        await agang.create_fsdp_gangs(gangs, intra_node_size)

    assert message in str(info.value)


async def test_create_fsdp_gangs_refuses_what_is_not_gangs() -> None:
    with pytest.raises(TypeError, match=r"`gangs` must be an `agang.Gangs`, but is of type `Fake"):
        await agang.create_fsdp_gangs(agang.FakeGang(), 2)  # type: ignore[arg-type]


def fake_gangs() -> agang.Gangs:
    """Gangs of size-1 fakes, each a distinct object."""
    return agang.Gangs(**{name: agang.FakeGang() for name in DIMENSIONS})


def test_gangs_checks_its_fields() -> None:
    fakes = {name: agang.FakeGang() for name in DIMENSIONS}

    with pytest.raises(TypeError, match=r"`tp` must be an `agang.Gang`, but is of type `str`"):
        agang.Gangs(**{**fakes, "tp": "tp"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`dp.rank` must be 0 on rank 0 of the root gang"):
        agang.Gangs(**{**fakes, "dp": agang.FakeGang(rank=1, size=2)})
    # Rank 0 of the root coordinates; other root ranks may have any rank elsewhere.
    agang.Gangs(**{**fakes, "root": agang.FakeGang(rank=1, size=2)})
    with pytest.raises(AttributeError):
        fake_gangs().tp = agang.FakeGang()  # type: ignore[misc]


# The current gangs. Sync tests run in a copied context, so nothing leaks between tests.


def in_own_context(test: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        contextvars.copy_context().run(test)

    run.__name__ = test.__name__
    return run


@in_own_context
def test_current_gangs_raises_lookup_error_when_none_are_set() -> None:
    with pytest.raises(
        LookupError, match=r"No gangs are current in this task; enter `with gangs:`"
    ):
        agang.current_gangs()


@in_own_context
def test_with_blocks_nest_and_restore() -> None:
    outer, inner = fake_gangs(), fake_gangs()

    with outer as entered:
        assert entered is outer
        assert agang.current_gangs() is outer
        with inner:
            assert agang.current_gangs() is inner
            with outer:  # the same gangs may be entered again
                assert agang.current_gangs() is outer
            assert agang.current_gangs() is inner
        assert agang.current_gangs() is outer
    with pytest.raises(LookupError):
        agang.current_gangs()


@in_own_context
def test_an_exception_leaves_the_block_and_restores() -> None:
    gangs = fake_gangs()

    with pytest.raises(KeyError), gangs:
        raise KeyError("x")
    with pytest.raises(LookupError):
        agang.current_gangs()


@in_own_context
def test_leaving_blocks_out_of_order_is_an_error() -> None:
    first, second = fake_gangs(), fake_gangs()
    first.__enter__()
    second.__enter__()

    with pytest.raises(RuntimeError, match="reverse order"):
        first.__exit__(None, None, None)


async def test_concurrent_tasks_see_their_own_gangs() -> None:
    first, second = fake_gangs(), fake_gangs()
    both_inside = anyio.Event()
    num_inside = 0
    seen: dict[str, list[agang.Gangs]] = {"first": [], "second": []}

    async def use(name: str, gangs: agang.Gangs) -> None:
        nonlocal num_inside
        with gangs:
            num_inside += 1
            if num_inside == 2:
                both_inside.set()
            await both_inside.wait()  # the other task is inside its block too
            for _ in range(3):
                seen[name].append(agang.current_gangs())
                await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as group:
        group.start_soon(use, "first", first)
        group.start_soon(use, "second", second)

    assert all(gangs is first for gangs in seen["first"])
    assert all(gangs is second for gangs in seen["second"])
    with pytest.raises(LookupError):
        agang.current_gangs()


async def test_started_tasks_inherit_the_gangs_and_do_not_leak_theirs() -> None:
    parent, child = fake_gangs(), fake_gangs()
    seen: list[agang.Gangs] = []

    async def task() -> None:
        seen.append(agang.current_gangs())
        child.__enter__()  # never left: the task's context ends with it
        seen.append(agang.current_gangs())

    with parent:
        async with anyio.create_task_group() as group:
            group.start_soon(task)
        assert agang.current_gangs() is parent

    assert seen[0] is parent
    assert seen[1] is child


# Helpers.


async def test_broadcast_flag_returns_the_source_flag_everywhere() -> None:
    async def program(gang: agang.Gang) -> tuple[bool, bool]:
        from_one = await agang.broadcast_flag(gang, gang.rank == 1, source_rank=1)
        from_zero = await agang.broadcast_flag(gang, gang.rank == 1)
        return from_one, from_zero

    assert await FakeWorld(3).run(program) == [(True, False)] * 3


async def test_all_sum_keeps_ints_exact_and_floats_float() -> None:
    async def program(gang: agang.Gang) -> tuple[int, float]:
        big = await agang.all_sum(gang, 2**60 + gang.rank)
        half = await agang.all_sum(gang, gang.rank / 2)
        return big, half

    for big, half in await FakeWorld(4).run(program):
        assert type(big) is int
        assert big == 4 * 2**60 + 6
        assert type(half) is float
        assert half == 3.0


async def test_helpers_on_a_fake_gang_treat_ranks_as_copies() -> None:
    gang = agang.FakeGang(rank=2, size=4)

    assert await agang.all_sum(gang, 3) == 12
    assert await agang.broadcast_flag(gang, True, source_rank=0)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda g: agang.broadcast_flag(g, 1),  # type: ignore[arg-type]
            TypeError,
            "`flag` must be a bool, but is of type `int`",
        ),
        (lambda g: agang.broadcast_flag(g, True, 4), ValueError, "`source_rank` must be"),
        (lambda g: agang.broadcast_flag(g, True, timeout=-1), ValueError, "`timeout` must be"),
        (
            lambda g: agang.broadcast_flag("g", True),  # type: ignore[arg-type]
            TypeError,
            "`gang` must be an `agang.Gang`",
        ),
        (
            lambda g: agang.all_sum(g, True),
            TypeError,
            "`value` must be an int or a float, but is of type `bool`",
        ),
        (
            lambda g: agang.all_sum(g, "1"),  # type: ignore[call-overload]
            TypeError,
            "`value` must be an int or a float",
        ),
        (lambda g: agang.all_sum(g, 2**63), ValueError, "`value` must fit in an int64"),
        (
            lambda g: agang.all_sum(None, 1),  # type: ignore[call-overload]
            TypeError,
            "`gang` must be an `agang.Gang`",
        ),
    ],
    ids=[
        "flag-int",
        "source-rank",
        "timeout",
        "flag-gang",
        "sum-bool",
        "sum-str",
        "sum-big",
        "sum-gang",
    ],
)
async def test_helpers_check_their_input(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        await call(agang.FakeGang(size=4))

    assert message in str(info.value)


async def test_gangs_close_closes_every_gang() -> None:
    async def program(root: agang.Gang) -> list[bool]:
        gangs = await agang.create_fsdp_gangs(
            await agang.create_parallel_gangs(root, tp_size=2), intra_node_size=2
        )
        await gangs.close()
        return [getattr(gangs, name).closed for name in DIMENSIONS]

    assert await FakeWorld(8).run(program) == [[True] * 6] * 8


# Real Gloo ranks. Programs are module-level: each rank imports them by name. One world
# runs both layouts, as starting the ranks is most of the cost.


async def _tp2_dp2_and_hybrid_sharding(root: agang.Gang) -> dict[str, Any]:
    gangs = await agang.create_parallel_gangs(root, tp_size=2)
    with gangs:
        assert agang.current_gangs() is gangs
        parallel: dict[str, Any] = await membership(gangs, root.rank)
        # Ranks 1 and 2 say yes: tp gang [0, 1] hears rank 1, tp gang [2, 3] rank 3.
        parallel["flag"] = await agang.broadcast_flag(gangs.tp, root.rank in (1, 2), source_rank=1)
        parallel["dp_sum"] = await agang.all_sum(gangs.dp, root.rank)

    fsdp = await agang.create_fsdp_gangs(await agang.create_parallel_gangs(root), intra_node_size=2)
    hybrid: dict[str, Any] = await membership(fsdp, root.rank)
    hybrid["sdp_sum"] = await agang.all_sum(fsdp.sdp, float(root.rank))
    return {"parallel": parallel, "hybrid": hybrid}


@pytest.mark.gloo
def test_tp2_dp2_and_hybrid_sharding_on_gloo() -> None:
    reports = run_world(_tp2_dp2_and_hybrid_sharding, 4, async_backend="trio")

    parallel = {
        "root": [[0, 1, 2, 3]],
        "tp": [[0, 1], [2, 3]],
        "dp": [[0, 2], [1, 3]],
        "sdp": [[0, 2], [1, 3]],
        "rdp": singletons(4),
        "pp": singletons(4),
    }
    hybrid = {
        "root": [[0, 1, 2, 3]],
        "dp": [[0, 1, 2, 3]],
        "sdp": [[0, 1], [2, 3]],
        "rdp": [[0, 2], [1, 3]],
        "tp": singletons(4),
        "pp": singletons(4),
    }
    for rank, report in enumerate(reports):
        got = report["parallel"]
        assert {name: got[name] for name in DIMENSIONS} == expected_membership(parallel, rank)
        got = report["hybrid"]
        assert {name: got[name] for name in DIMENSIONS} == expected_membership(hybrid, rank)
    assert [r["parallel"]["flag"] for r in reports] == [True, True, False, False]
    assert [r["parallel"]["dp_sum"] for r in reports] == [2, 4, 2, 4]
    assert [r["hybrid"]["sdp_sum"] for r in reports] == [1.0, 1.0, 5.0, 5.0]
