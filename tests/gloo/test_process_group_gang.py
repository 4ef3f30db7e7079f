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


async def _refused_before_issue(gang: agang.Gang) -> dict[str, Any]:
    """Lazy views and an all_to_all in place are refused on every rank before issue, and
    the gang goes on: unrefused, Gloo fails the conjugated view once issued (breaking the
    gang on every rank), reduces the negated one un-negated and overwrites rows of the
    all_to_all, neither with an error."""
    refused = []
    x = torch.full((4,), complex(1, gang.rank + 1), dtype=torch.complex64)
    y = torch.full((4,), float(gang.rank + 1))
    t = torch.arange(4.0) + 10 * gang.rank
    for bad in (
        lambda: gang.all_reduce(x.conj()),
        lambda: gang.all_reduce(torch._neg_view(y)),
        lambda: gang.all_to_all(t, t),
        lambda: gang.all_to_all(t[1:3], t[:2], output_split_sizes=[1, 1]),
    ):
        try:
            bad()
        except ValueError as error:
            refused.append(str(error).split(";")[0])
    return {
        "refused": refused,
        "num_issued": gang.statistics().num_issued,
        "conj": (await gang.all_reduce(x.conj().resolve_conj())).tolist(),
        "neg": (await gang.all_reduce(torch._neg_view(y).resolve_neg())).tolist(),
        "all_to_all": (await gang.all_to_all(torch.empty(4), t)).tolist(),
    }


def test_lazy_views_and_overlapping_all_to_all_are_refused_on_gloo() -> None:
    reports = run_world(_refused_before_issue, 2, async_backend="asyncio")

    for rank, report in enumerate(reports):
        assert report["refused"] == [
            "`tensor` must hold its values in memory, but is a lazily conjugated view "
            "(`is_conj()` is True) instead",
            "`tensor` must hold its values in memory, but is a lazily negated view "
            "(`is_neg()` is True) instead",
            "`output` must not overlap `input` in memory, but does",
            "`output` must not overlap `input` in memory, but does",
        ]
        assert report["num_issued"] == 0
        assert report["conj"] == [complex(2, -3)] * 4
        assert report["neg"] == [-3.0] * 4
        assert report["all_to_all"] == [2 * rank, 2 * rank + 1, 10 + 2 * rank, 11 + 2 * rank]
