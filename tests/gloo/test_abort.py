"""Aborting a Gloo group ends its running work (``agang._backends.c10d.abort``), on real Gloo ranks.

One world of two ranks, each part on a lane of its own so that an abort breaks only
that lane. Bounds keep a 10x margin: an abort ends work in milliseconds, while work
that is not aborted runs until the peer's connections close (here: never, within the
test) or c10d's own timeout (60 s or more).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import agang
from agang._backends.c10d.abort import abort_group
from agang.testing import run_world

pytestmark = pytest.mark.gloo

SETTLE = 0.3  # long enough for a healthy abort to have ended the work
PROMPT = 1.0  # an abort ends work well within this
TIMEOUT = 0.5  # the agang deadline in part B


def _wait_for_error(work: Any) -> str | None:
    """Blocks until ``work`` ends; its error's text, or None when it succeeded."""
    try:
        work.wait()
    except Exception as error:
        return str(error)
    return None


async def _raw_abort(gang: agang.Gang) -> dict[str, Any]:
    """Part A, raw c10d on a lane's group: rank 0 starts an all_reduce that rank 1 never
    joins, calls Gloo's own ``abort()``, then ``abort_group``; rank 1 waits meanwhile on
    a recv from rank 0 that rank 0 never sends."""
    assert isinstance(gang, agang.ProcessGroupGang)
    group = gang.process_group
    started = time.monotonic()
    if gang.rank == 1:
        work = group.recv([torch.empty(1)], 0, 7)
        error = await anyio.to_thread.run_sync(_wait_for_error, work)
        return {"peer_error": error, "peer_waited": time.monotonic() - started}
    work = group.allreduce([torch.ones(4)])
    await anyio.sleep(SETTLE)
    group.abort()
    await anyio.sleep(SETTLE)
    running_after_gloo_abort = not work.is_completed()
    aborting_at = time.monotonic()
    abort_group(group, "gloo")
    error = await anyio.to_thread.run_sync(_wait_for_error, work)
    return {
        "running_after_gloo_abort": running_after_gloo_abort,
        "ended_after": time.monotonic() - aborting_at,
        "error": error,
    }


async def _timeout_aborts(gang: agang.Gang) -> dict[str, Any]:
    """Part B, through agang: rank 0's all_reduce misses its deadline (rank 1 never
    joins it), so the lane breaks and aborts its group (``on_timeout="abort"``)."""
    started = time.monotonic()
    if gang.rank == 1:
        try:
            await gang.recv(torch.empty(4), 0)  # rank 0 never sends: only an abort ends it
        except agang.GangError as error:
            return {"peer_error": type(error).__name__, "peer_waited": time.monotonic() - started}
        return {"peer_error": None}
    tensor = torch.ones(4)
    with contextlib.suppress(agang.GangTimeoutError):
        await gang.all_reduce(tensor, timeout=TIMEOUT)
    timed_out_at = time.monotonic()
    # The registry of busy memory is process-wide: a FakeGang sees the lane's claim.
    probe = agang.FakeGang(rank=0, size=2)
    freed_after = None
    with anyio.move_on_after(10 * PROMPT):
        while True:
            try:
                await probe.all_reduce(tensor)
            except agang.TensorBusyError:
                await anyio.sleep(0.01)
                continue
            freed_after = time.monotonic() - timed_out_at
            break
    return {"freed_after": freed_after, "timed_out": gang.statistics().num_timed_out}


async def _both_parts(gang: agang.Gang) -> dict[str, Any]:
    raw = await gang.lane("raw")
    timeout = await gang.lane("timeout")
    report = {"raw": await _raw_abort(raw), "timeout": await _timeout_aborts(timeout)}
    await gang.barrier()  # the root gang is untouched by its lanes' aborts
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict[str, Any]]:
    return run_world(_both_parts, 2, async_backend="asyncio", timeout=60.0)


def test_gloo_abort_alone_leaves_running_work_running(reports: list[dict[str, Any]]) -> None:
    """The c10d fact that ``_abort`` rests on (torch 2.13): ``ProcessGroup.abort()`` on
    Gloo does not end an all_reduce in progress. If a newer torch ends it, this test
    fails, and the receive trick in ``_abort`` may go."""
    assert reports[0]["raw"]["running_after_gloo_abort"]


def test_abort_group_ends_running_work_at_once(reports: list[dict[str, Any]]) -> None:
    raw = reports[0]["raw"]

    assert raw["ended_after"] < PROMPT
    assert raw["error"] is not None  # it failed, it did not complete


def test_the_peer_of_an_aborting_rank_fails_instead_of_hanging(
    reports: list[dict[str, Any]],
) -> None:
    """Rank 1's recv from rank 0 fails once rank 0 aborts (about 2 x SETTLE in)."""
    raw = reports[1]["raw"]

    assert raw["peer_error"] is not None
    assert raw["peer_waited"] < 2 * SETTLE + PROMPT


def test_a_timed_out_op_is_ended_and_its_tensor_freed(reports: list[dict[str, Any]]) -> None:
    """With ``on_timeout="abort"`` the op is really ended, not only given up on: its
    tensor is free again promptly, and the peer's op with this rank fails too."""
    timeout = reports[0]["timeout"]
    peer = reports[1]["timeout"]

    assert timeout["timed_out"] == 1
    assert timeout["freed_after"] is not None
    assert timeout["freed_after"] < PROMPT
    assert peer["peer_error"] == "CollectiveError"
    assert peer["peer_waited"] < TIMEOUT + PROMPT
