"""``agang.testing.run_world`` without a gang (``make_gang=False``): what the benchmarks
use to time their own set-up, on real Gloo ranks over loopback."""

from __future__ import annotations

import os

import pytest
import torch

import agang
from agang.testing import run_world

pytestmark = pytest.mark.gloo


def _sum_of_ranks() -> tuple[str, float]:
    """A rank making its own gang from the world's environment, as a bench does."""
    gang = agang.init_sync(in_process=False, timeout=60.0)
    try:
        total = gang.all_reduce(torch.full((1,), float(gang.rank))).wait()
        return os.environ["RANK"], total.item()
    finally:
        gang.close_sync()


def test_ranks_without_a_gang_can_make_their_own_from_the_world_s_environment() -> None:
    assert run_world(_sum_of_ranks, 2, make_gang=False, timeout=120.0) == [("0", 1.0), ("1", 1.0)]


def test_init_options_are_refused_where_no_gang_is_made() -> None:
    with pytest.raises(ValueError, match="`init_options` must be None"):
        run_world(_sum_of_ranks, 2, make_gang=False, init_options={"check_order": "full"})  # type: ignore[call-overload]
