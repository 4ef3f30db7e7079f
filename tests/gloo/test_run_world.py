"""``agang.testing.run_world`` without a gang (``make_gang=False``): what the benchmarks
use to time their own set-up, on real Gloo ranks over loopback; and how it judges a rank
that returned its result, then was slow to exit or crashed at exit."""

from __future__ import annotations

import atexit
import logging
import os
import time

import pytest
import torch

import agang
from agang.testing import WorldRunError, run_world
from agang.testing import _run_world as run_world_module

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


def _return_then_linger() -> str:
    """Returns, then lingers at exit (an atexit sleep, as a thread still finishing would):
    ``run_world`` kills it at its exit grace."""
    atexit.register(time.sleep, 120.0)
    return os.environ["RANK"]


def _return_then_crash_at_exit() -> str:
    """Returns, then exits with code 3 at once, on its own (a crash at exit)."""
    atexit.register(os._exit, 3)
    return os.environ["RANK"]


def test_a_rank_slow_to_exit_after_its_result_is_logged_not_failed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # 1 s of grace, not 15: each lingering rank is killed (SIGKILL) after it.
    monkeypatch.setattr(run_world_module, "_EXIT_GRACE", 1.0)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="agang.testing"):
        assert run_world(_return_then_linger, 2, make_gang=False, timeout=120.0) == ["0", "1"]
    # Killed, not waited out: the ranks would sleep 120 s.
    assert time.monotonic() - started < 100.0
    noted = [r.getMessage() for r in caplog.records if r.name == "agang.testing"]
    assert len(noted) == 2
    assert all("returned its result, then was still exiting" in m for m in noted)


def test_a_rank_that_crashes_at_exit_after_its_result_still_fails() -> None:
    with pytest.raises(WorldRunError) as raised:
        run_world(_return_then_crash_at_exit, 2, make_gang=False, timeout=120.0)
    assert raised.value.results == {0: "0", 1: "1"}
    assert raised.value.failures == {
        rank: f"rank {rank} returned its result, then exited with code 3" for rank in (0, 1)
    }
