"""A shape that differs between ranks fails the op on every rank, by default.

On Gloo a rank that receives more bytes than it expects is killed by Gloo (SIGABRT,
"Received data size doesn't match expected size"), in every collective (torch 2.13,
measured). So a Gloo gang checks order by default (``agang._policy``): the ranks'
fingerprints are compared before the op starts, and a shape, dtype, reduce op or root
that differs raises ``CollectiveMismatchError`` on every rank, naming each rank's call,
and nothing is started. Real Gloo ranks, default settings; ``AGANG_CHECK_ORDER=0``
turns the default off.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo


async def _all_reduce_of_own_length(gang: agang.Gang) -> dict[str, Any]:
    """Rank r all-reduces 4 * (r + 1) elements; then the gang refuses further ops."""
    checked = gang.policy.check_order
    await gang.all_reduce(torch.ones(2))
    try:
        await gang.all_reduce(torch.ones(4 * (gang.rank + 1)))
    except agang.CollectiveMismatchError as error:
        with pytest.raises(agang.GangBrokenError):
            await gang.all_reduce(torch.ones(2))
        return {"checked": checked, "message": str(error), "fingerprints": error.fingerprints}
    return {"checked": checked, "message": "no error"}


def test_a_shape_that_differs_between_ranks_raises_on_every_rank() -> None:
    # One loop (asyncio): the check compares the ranks' fingerprints before any op
    # starts, the same on every loop; tests/world's order checks run it on all three.
    reports = run_world(_all_reduce_of_own_length, 2, async_backend="asyncio", timeout=60.0)
    for rank, report in enumerate(reports):
        assert report["checked"] is True, report  # the default on Gloo
        message = report["message"]
        assert message.startswith(f"`all_reduce` (seq 1) on gang 'root' (rank {rank} of 2"), report
        assert "called `all_reduce` with different arguments" in message, report
        assert "(`float32[4]` against `float32[8]`)" in message, report
        assert "Nothing was started" in message, report
        assert report["fingerprints"] == {
            0: "all_reduce(SUM, float32[4])",
            1: "all_reduce(SUM, float32[8])",
        }


async def _policy_of(gang: agang.Gang) -> object:
    return gang.policy.check_order


def test_the_default_is_turned_off_by_the_environment_or_the_argument() -> None:
    off = run_world(_policy_of, 2, timeout=60.0, env={"AGANG_CHECK_ORDER": "0"})
    assert off == [False, False]
    off = run_world(_policy_of, 2, timeout=60.0, init_options={"check_order": False})
    assert off == [False, False]


def test_an_in_process_gang_does_not_check_by_default() -> None:
    gang = agang.init_sync(in_process=True, env={})
    try:
        assert gang.policy.check_order is False  # one rank: nothing to mismatch
    finally:
        gang.close_sync()
