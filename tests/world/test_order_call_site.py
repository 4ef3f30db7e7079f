"""Order checking's call-site mode (hardening, finding 7).

Two all-reduces of equal op, shape and dtype issued in swapped order on one rank have
equal fingerprints: plain order checking passes them, and each rank's tensors get the
other's values (a = b = 11 where 2 and 20 were meant). ``check_order="call_site"`` puts
the issuing line into each fingerprint, so the swap fails with
``CollectiveMismatchError`` on every rank before anything starts.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import agang
from agang._policy import make_policy
from agang.testing import FakeWorld, run_world


async def _swapped(gang: agang.Gang) -> dict[str, Any]:
    a, b = torch.ones(1), torch.full((1,), 10.0)
    try:
        if gang.rank == 0:
            first, second = gang.all_reduce(a), gang.all_reduce(b)
        else:
            second, first = gang.all_reduce(b), gang.all_reduce(a)
        await first
        await second
    except agang.GangError as error:  # the mismatch, or the break it caused
        return {"error": str(error)}
    return {"a": a.item(), "b": b.item()}


@pytest.mark.anyio
async def test_plain_order_checking_cannot_see_swapped_ops_of_equal_shape() -> None:
    results = await FakeWorld(2, check_order=True).run(_swapped)
    assert results == [{"a": 11.0, "b": 11.0}] * 2  # the documented blind spot


@pytest.mark.anyio
async def test_call_site_mode_fails_swapped_ops_of_equal_shape() -> None:
    results = await FakeWorld(2, check_order="call_site").run(_swapped)
    for result in results:
        assert "different collectives" in result["error"]
        assert "test_order_call_site.py:" in result["error"]


@pytest.mark.gloo
def test_call_site_mode_fails_swapped_ops_on_gloo() -> None:
    results = run_world(_swapped, 2, timeout=90.0, init_options={"check_order": "call_site"})
    assert all("different collectives" in r["error"] for r in results), results


async def _same_program(gang: agang.Gang) -> list[float]:
    outs = []
    for value in (1.0, 10.0):  # one line issues both ops, on every rank
        outs.append((await gang.all_reduce(torch.full((1,), value))).item())
    return outs


@pytest.mark.anyio
async def test_call_site_mode_passes_a_program_that_issues_in_order() -> None:
    assert await FakeWorld(3, check_order="call_site").run(_same_program) == [[3.0, 30.0]] * 3


def test_call_site_mode_from_the_environment_and_bad_values() -> None:
    policy = make_policy(op_timeout=math.inf, env={"AGANG_CHECK_ORDER": "call_site"})
    assert policy.check_order == "call_site"
    with pytest.raises(ValueError, match="AGANG_CHECK_ORDER"):
        make_policy(op_timeout=math.inf, env={"AGANG_CHECK_ORDER": "yes"})
    with pytest.raises(TypeError, match="`check_order`"):
        make_policy(op_timeout=math.inf, check_order="site")
