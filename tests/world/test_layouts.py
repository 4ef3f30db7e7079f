"""``all_gather`` and ``reduce_scatter`` take both layouts of the per-rank blocks.

Stacked, ``[size, *block]``, and concatenated along the first dimension,
``[size * block[0], *block[1:]]`` (c10d's ``all_gather_into_tensor`` and
``reduce_scatter_tensor``): the same bytes in the same order, so both give the same
values, equal to c10d's, on FakeWorld, on FakeGang and on real Gloo. Both also run in
place, with this rank's block of the gathered tensor as ``input`` to ``all_gather`` and of
the scattered one as ``output`` to ``reduce_scatter``: c10d allows it, and so does agang,
which refuses other overlaps (``all_to_all(t, t)``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import agang
from agang.testing import FakeWorld, run_world

BLOCK = (2, 3)


def _input(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(BLOCK) + 10 * rank


def _scatter_input(rank: int, size: int) -> torch.Tensor:
    return torch.arange(size * 6, dtype=torch.float32).reshape(size, *BLOCK) * (rank + 1)


async def _both_layouts(gang: agang.Gang) -> dict[str, Any]:
    size = gang.size
    x = _input(gang.rank)
    stacked = await gang.all_gather(torch.empty(size, *BLOCK), x)
    concatenated = await gang.all_gather(torch.empty(size * BLOCK[0], BLOCK[1]), x)
    y = _scatter_input(gang.rank, size)
    from_stacked = await gang.reduce_scatter(torch.empty(BLOCK), y)
    from_concatenated = await gang.reduce_scatter(
        torch.empty(BLOCK), y.reshape(size * BLOCK[0], BLOCK[1])
    )
    gathered = torch.zeros(size, *BLOCK)
    gathered[gang.rank] = x
    in_place = await gang.all_gather(gathered, gathered[gang.rank])
    z = _scatter_input(gang.rank, size)
    in_place_shard = await gang.reduce_scatter(z[gang.rank], z)
    return {
        "stacked": stacked,
        "concatenated": concatenated,
        "from_stacked": from_stacked,
        "from_concatenated": from_concatenated,
        "in_place": in_place,
        "in_place_shard": in_place_shard,
    }


def _check(report: dict[str, Any], rank: int, size: int) -> None:
    inputs = [_input(r) for r in range(size)]
    assert torch.equal(report["stacked"], torch.stack(inputs))
    assert torch.equal(report["concatenated"], torch.cat(inputs))
    expected = sum(_scatter_input(r, size)[rank] for r in range(size))
    assert torch.equal(report["from_stacked"], expected)
    assert torch.equal(report["from_concatenated"], expected)
    assert torch.equal(report["in_place"], torch.stack(inputs))
    assert torch.equal(report["in_place_shard"], expected)


@pytest.mark.anyio
async def test_both_layouts_give_the_same_values_on_a_fake_world() -> None:
    reports = await FakeWorld(3).run(_both_layouts)
    for rank, report in enumerate(reports):
        _check(report, rank, 3)


@pytest.mark.anyio
async def test_fake_gang_takes_both_layouts() -> None:
    gang = agang.FakeGang(rank=1, size=2)
    x = _input(0)
    out = await gang.all_gather(torch.empty(4, 3), x)
    assert torch.equal(out, torch.cat([x, x]))
    y = torch.ones(4, 3)
    shard = await gang.reduce_scatter(torch.empty(BLOCK), y)
    assert torch.equal(shard, torch.full(BLOCK, 2.0))  # two copies of this rank's block


@pytest.mark.anyio
async def test_fake_gang_gathers_and_scatters_in_place() -> None:
    gang = agang.FakeGang(rank=1, size=2)
    x = _input(0)
    gathered = torch.zeros(2, *BLOCK)
    gathered[1] = x
    assert torch.equal(await gang.all_gather(gathered, gathered[1]), torch.stack([x, x]))
    rows = torch.zeros(4, 3)
    rows[2:] = x
    assert torch.equal(await gang.all_gather(rows, rows[2:]), torch.cat([x, x]))
    split = torch.zeros(4, 3)
    split[2:] = x
    uneven = await gang.all_gather(split, split[2:], output_split_sizes=[2, 2])
    assert torch.equal(uneven, torch.cat([x, x]))
    y = _scatter_input(0, 2)
    shard = await gang.reduce_scatter(y[1], y)
    assert torch.equal(shard, 2 * _scatter_input(0, 2)[1])  # two copies of this rank's block


@pytest.mark.anyio
async def test_a_shape_of_neither_layout_is_refused_naming_both() -> None:
    gang = agang.FakeGang(rank=0, size=2)
    with pytest.raises(
        ValueError,
        match=r"`output` must have shape \(2, 2, 3\) \(stacked\) or "
        r"\(4, 3\) \(concatenated\), but has shape \(3, 3\)",
    ):
        gang.all_gather(torch.empty(3, 3), _input(0))
    with pytest.raises(
        ValueError,
        match=r"`input` must have shape \(2, 2, 3\) \(stacked\) or "
        r"\(4, 3\) \(concatenated\)",
    ):
        gang.reduce_scatter(torch.empty(BLOCK), torch.empty(2, 6))
    with pytest.raises(ValueError, match=r"`output` must have shape \(2,\), but has"):
        gang.all_gather(torch.empty(1, 2), torch.tensor(1.0))  # a 0-dim block: one layout


async def _against_c10d(gang: agang.Gang) -> dict[str, Any]:
    report = await _both_layouts(gang)
    size = gang.size
    gathered = torch.empty(size * BLOCK[0], BLOCK[1])
    dist.all_gather_into_tensor(gathered, _input(gang.rank))
    scattered = torch.empty(BLOCK)
    dist.reduce_scatter_tensor(
        scattered, _scatter_input(gang.rank, size).reshape(size * BLOCK[0], BLOCK[1])
    )
    return {**report, "c10d_gathered": gathered, "c10d_scattered": scattered}


@pytest.mark.gloo
def test_both_layouts_match_c10d_on_gloo() -> None:
    reports = run_world(_against_c10d, 2, async_backend="asyncio", timeout=60.0)
    for rank, report in enumerate(reports):
        _check(report, rank, 2)
        assert torch.equal(report["concatenated"], report["c10d_gathered"])
        assert torch.equal(report["from_concatenated"], report["c10d_scattered"])
