"""The process-group gang on real Gloo ranks: sub-gangs and their lifecycle."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo


async def _sub_gangs(gang: agang.Gang) -> dict[str, Any]:
    """Ranks {0, 2} of 3 form a sub-gang; rank 1 gets None; both gangs keep working."""
    pair = await gang.create_gang([2, 0])
    report: dict[str, Any] = {"is_member": pair is not None}
    if pair is not None:
        report["rank_size"] = (pair.rank, pair.size)
        report["sum"] = (await pair.all_reduce(torch.tensor([float(gang.rank)]))).item()
        report["gathered"] = await pair.all_gather_objects(gang.rank)
    report["world_sum"] = (await gang.all_reduce(torch.ones(1))).item()
    if pair is not None:
        await pair.close()
        report["pair_closed"] = pair.closed
    report["world_after_pair_closed"] = (await gang.all_reduce(torch.ones(1))).item()
    return report


def test_create_gang_makes_a_working_sub_gang() -> None:
    reports = run_world(_sub_gangs, 3, async_backend="uvloop")

    assert [r["is_member"] for r in reports] == [True, False, True]
    assert reports[0]["rank_size"] == (0, 2)
    assert reports[2]["rank_size"] == (1, 2)
    assert reports[0]["sum"] == reports[2]["sum"] == 2.0
    assert reports[0]["gathered"] == reports[2]["gathered"] == [0, 2]
    assert all(r["world_sum"] == r["world_after_pair_closed"] == 3.0 for r in reports)
    assert reports[0]["pair_closed"]
    assert reports[2]["pair_closed"]


def _refusal(call: Any) -> str:
    try:
        call()
    except Exception as error:
        return type(error).__name__
    return "accepted"


async def _close_parent(gang: agang.Gang) -> dict[str, Any]:
    """Closing the world closes its sub-gangs: they refuse ops afterwards, also ops with a
    deadline longer than any before (which raises c10d's own timeout on a live group)."""
    everyone = await gang.create_gang(list(range(gang.size)))
    assert everyone is not None
    await everyone.barrier()
    await gang.close()
    return {
        "child_closed": everyone.closed,
        "child": _refusal(everyone.barrier),
        "long_timeout": [
            _refusal(lambda g=g: g.all_reduce(torch.ones(2), timeout=10_000.0))  # type: ignore[misc]
            for g in (gang, everyone)
        ],
    }


def test_closing_the_parent_closes_sub_gangs() -> None:
    for report in run_world(_close_parent, 2):
        assert report == {
            "child_closed": True,
            "child": "GangClosedError",
            "long_timeout": ["GangClosedError", "GangClosedError"],
        }
