"""Tensors that require grad as collective results (hardening, finding 6a).

c10d writes results into a leaf that requires grad as it would into any tensor (its
kernels bypass autograd); agang's own writes (MEAN's divide, the copies out of coalesced
and bucketed buffers) did not: the divide failed on the backend's thread after the op
had been sent, breaking the gang on every rank with the tensor summed but not divided.
Now agang writes results as c10d does, and the gang stays usable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import agang
from agang import ReduceOp
from agang.testing import FakeWorld, run_world


async def _results_into_leaves_that_require_grad(gang: agang.Gang) -> dict[str, Any]:
    value = float(gang.rank + 1)
    leaf = torch.full((3,), value, requires_grad=True)
    await gang.all_reduce(leaf, ReduceOp.MEAN)
    pair = [torch.full((2,), value, requires_grad=True), torch.full((2, 2), value * 10)]
    pair[1].requires_grad_(True)
    await gang.all_reduce_bucketed(pair, ReduceOp.MEAN)
    with gang.coalesce() as coalesced:
        gang.all_reduce(pair[0], ReduceOp.SUM)
        gang.all_reduce(pair[1], ReduceOp.SUM)
    await coalesced
    after = await gang.all_reduce(torch.ones(1))  # the gang is still usable
    return {
        "leaf": leaf.tolist(),
        "pair": [t.reshape(-1).tolist() for t in pair],
        "still_leaves": all(t.is_leaf and t.requires_grad for t in [leaf, *pair]),
        "after": after.item(),
    }


def _expected(size: int) -> dict[str, Any]:
    mean = sum(range(1, size + 1)) / size
    return {
        "leaf": [mean] * 3,
        "pair": [[mean * size] * 2, [mean * 10 * size] * 4],
        "still_leaves": True,
        "after": float(size),
    }


@pytest.mark.gloo
def test_mean_into_a_leaf_that_requires_grad_on_gloo() -> None:
    results = run_world(_results_into_leaves_that_require_grad, 2, timeout=90.0)
    assert results == [_expected(2)] * 2


@pytest.mark.anyio
async def test_mean_into_a_leaf_that_requires_grad_on_the_fakes() -> None:
    assert await FakeWorld(3).run(_results_into_leaves_that_require_grad) == [_expected(3)] * 3
    gang = agang.FakeGang(rank=0, size=2)
    assert await _results_into_leaves_that_require_grad(gang) == {
        "leaf": [1.0] * 3,
        "pair": [[2.0] * 2, [20.0] * 4],  # every fake rank holds rank 0's values
        "still_leaves": True,
        "after": 2.0,
    }
