"""One meaning of a timeout argument everywhere: None is the default, ``math.inf`` none."""

from __future__ import annotations

import math

import pytest
import torch

import agang
from agang._policy import DEFAULT_OP_TIMEOUT, make_policy
from agang._setup.init import DEFAULT_INIT_TIMEOUT, _start
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("given", "kept"), [(None, DEFAULT_OP_TIMEOUT), (math.inf, None), (2.5, 2.5), (0, 0.0)]
)
def test_a_gangs_op_timeout_none_is_the_default_and_inf_is_none(
    given: float | None, kept: float | None
) -> None:
    assert make_policy(op_timeout=given).op_timeout == kept


@pytest.mark.parametrize("given", [-1.0, math.nan, "5", True])
def test_a_bad_op_timeout_is_refused_by_name(given: object) -> None:
    with pytest.raises((TypeError, ValueError), match="`op_timeout`"):
        make_policy(op_timeout=given)


@pytest.mark.parametrize(
    ("given", "kept"), [(None, DEFAULT_INIT_TIMEOUT), (math.inf, None), (7.0, 7.0)]
)
def test_inits_timeout_none_is_the_default_and_inf_is_none(
    given: float | None, kept: float | None
) -> None:
    plan, handle = _start(
        backend=None,
        device=None,
        timeout=given,
        op_timeout=None,
        env={},
        world=None,
        in_process=True,
        stream_ordered=False,
        retry=None,
        on_timeout="abort",
        limits=None,
        check_order=None,
    )
    assert handle is None  # in-process: nothing was started
    assert plan.timeout == kept


@pytest.mark.parametrize(
    ("op_timeout", "call", "deadline"),
    [
        (None, None, DEFAULT_OP_TIMEOUT),  # the gang's default, itself agang's default
        (math.inf, None, None),  # a gang without a default deadline
        (4.0, None, 4.0),
        (4.0, math.inf, None),  # this op without one
        (math.inf, 3.0, 3.0),
    ],
)
async def test_an_ops_timeout_none_is_its_gangs_and_inf_is_none(
    op_timeout: float | None, call: float | None, deadline: float | None
) -> None:
    gang = await agang.init(in_process=True, op_timeout=op_timeout, env={})
    handle = gang.all_reduce(torch.ones(1), timeout=call)
    assert handle.timeout == deadline
    await handle
    await gang.close()


async def test_a_fake_worlds_op_timeout_follows_the_rule() -> None:
    for given, deadline in ((None, DEFAULT_OP_TIMEOUT), (math.inf, None)):
        world = FakeWorld(1, op_timeout=given)
        handle = world[0].all_reduce(torch.ones(1))
        assert handle.timeout == deadline
        await handle
