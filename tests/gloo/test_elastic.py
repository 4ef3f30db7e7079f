"""Elastic gangs on real Gloo processes around an ``agang store``: a rank is killed, the
survivors reform, a replacement joins at a step boundary, and too few members fail with
the missing named.

The ranks run this file as a script (``python tests/gloo/test_elastic.py train``), each a
process of its own; the test starts them, kills one by pid, starts the replacement, and
ends every process it started.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from storeutil import Lines, Store, clean_env

import agang

pytestmark = pytest.mark.gloo

KILL_AT = 8  # the step at which old rank 1 is killed
STEPS_IN_LAST_EPOCH = 5
OP_TIMEOUT = 5.0


def _start(
    started: list[subprocess.Popen[str]], program: str, port: int, rank: int, size: int
) -> Lines:
    env = clean_env(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK="0",
    )
    process = subprocess.Popen(
        [sys.executable, __file__, program],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    started.append(process)
    lines = Lines(process.stdout)
    lines.process = process  # type: ignore[attr-defined]
    return lines


def _result(lines: Lines, timeout: float) -> dict[str, Any]:
    return dict(json.loads(lines.wait_for("RESULT ", timeout).split(" ", 1)[1]))


@pytest.fixture(scope="module")
def kill_and_join() -> Iterator[dict[str, Any]]:
    started: list[subprocess.Popen[str]] = []
    try:
        store = Store(started, "--port", "0")
        port = int(store.out.next(30).rsplit(":", 1)[1])
        workers = [_start(started, "train", port, rank, 3) for rank in range(3)]
        workers[1].wait_for(f"STEP {KILL_AT - 1} ", 60)
        os.kill(started[2].pid, signal.SIGKILL)  # old rank 1, by pid
        killed_at = time.monotonic()
        workers[0].wait_for("EPOCH 1 ", 30)
        replacement = _start(started, "train", port, 1, 3)
        results = [_result(workers[0], 60), _result(workers[2], 60), _result(replacement, 60)]
        codes = [process.wait(30) for process in started[1:]]
        yield {
            "results": results,
            "codes": codes,
            "killed_at": killed_at,
            "store_alive": store.process.poll() is None,
        }
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(10)


def test_the_survivors_of_a_killed_rank_reform_in_their_order(
    kill_and_join: dict[str, Any],
) -> None:
    first, third, _ = kill_and_join["results"]
    # Epoch 1: the two survivors, keeping their relative order (old ranks 0 and 2).
    assert first["epochs"]["1"] == {"rank": 0, "size": 2}, first
    assert third["epochs"]["1"] == {"rank": 1, "size": 2}, third
    # Found out by the failed op, then reformed within seconds (about 0.4 s here).
    print(f"recovered in: {first['recovered_in']}, {third['recovered_in']} s")
    for result in (first, third):
        assert result["failures"][0] in ("CollectiveError", "GangTimeoutError", "GangBrokenError")
        assert result["recovered_in"][0] < OP_TIMEOUT + 10, result
    assert kill_and_join["codes"][1] == -signal.SIGKILL


def test_a_replacement_joins_at_the_next_step_boundary_and_all_results_are_right(
    kill_and_join: dict[str, Any],
) -> None:
    first, third, replacement = kill_and_join["results"]
    assert first["epochs"]["2"] == {"rank": 0, "size": 3}
    assert third["epochs"]["2"] == {"rank": 1, "size": 3}
    assert replacement["epochs"] == {"2": {"rank": 2, "size": 3}}  # joiners follow (JSON keys)
    for result in (first, third, replacement):
        assert result["wrong"] == [], result  # every all-reduce's sum was right
        assert result["last_epoch_steps"] == STEPS_IN_LAST_EPOCH
    assert [kill_and_join["codes"][i] for i in (0, 2, 3)] == [0, 0, 0]
    assert kill_and_join["store_alive"]  # the store outlives every rank


def test_too_few_members_at_the_reform_deadline_name_the_missing() -> None:
    started: list[subprocess.Popen[str]] = []
    try:
        store = Store(started, "--port", "0")
        port = int(store.out.next(30).rsplit(":", 1)[1])
        workers = [_start(started, "too_few", port, rank, 2) for rank in range(2)]
        result = _result(workers[0], 60)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(10)
    assert result["error"] == "GangInitError", result
    assert "fewer than min_size=2" in result["message"], result
    assert f"pid {result['peer_pid']}" in result["message"], result  # the missing, named
    assert 2.0 <= result["took"] < 2.0 + 5.0, result  # at the 2 s reform deadline


def test_elastic_settings_are_checked_and_other_gangs_are_not_elastic() -> None:
    with pytest.raises(ValueError, match="`min_size` must be at least 1"):
        agang.Elastic(min_size=0)
    with pytest.raises(ValueError, match="`max_size` must be at least `min_size`"):
        agang.Elastic(min_size=3, max_size=2)
    with pytest.raises(TypeError, match="`min_size` must be an int"):
        agang.Elastic(min_size=1.5)  # type: ignore[arg-type]
    gang = agang.FakeGang()
    assert gang.epoch == 0
    with pytest.raises(agang.GangError, match="not elastic"):
        gang.waiting_to_join()


# -- the ranks' programs ----------------------------------------------------------------


async def _train() -> dict[str, Any]:
    import torch

    gang = await agang.init(elastic=agang.Elastic(min_size=2), timeout=60, op_timeout=OP_TIMEOUT)
    report: dict[str, Any] = {"epochs": {}, "failures": [], "recovered_in": [], "wrong": []}
    report["epochs"][gang.epoch] = {"rank": gang.rank, "size": gang.size}
    step = last_epoch_steps = 0
    while last_epoch_steps < STEPS_IN_LAST_EPOCH and step < 500:
        try:
            # At a step boundary, the ranks agree on whether anyone waits to join.
            if await agang.broadcast_flag(gang, gang.waiting_to_join() > 0):
                # Every member is here: no deadline (math.inf) costs nothing, and its
                # groups take c10d's backstop behind an op with no deadline.
                gang = await gang.reform(timeout=math.inf)
                report["epochs"][gang.epoch] = {"rank": gang.rank, "size": gang.size}
                print(f"EPOCH {gang.epoch} ", flush=True)
                continue  # a new epoch starts at the top, as a joiner's first step does
            total = await gang.all_reduce(torch.full((4,), float(gang.rank + 1)))
        except agang.GangError as error:
            failed_at = time.monotonic()
            report["failures"].append(type(error).__name__)
            gang = await gang.reform(timeout=30)
            report["recovered_in"].append(time.monotonic() - failed_at)
            report["epochs"][gang.epoch] = {"rank": gang.rank, "size": gang.size}
            print(f"EPOCH {gang.epoch} ", flush=True)
            continue
        expected = gang.size * (gang.size + 1) / 2
        if total.tolist() != [expected] * 4:
            report["wrong"].append((step, total.tolist()))
        print(f"STEP {step} ", flush=True)
        step += 1
        last_epoch_steps = last_epoch_steps + 1 if gang.epoch >= 2 else 0
        await _pace(gang)
    report["last_epoch_steps"] = last_epoch_steps
    await gang.close()
    return report


async def _pace(gang: agang.Gang) -> None:
    import anyio

    # Slow enough for the test to kill a rank and start its replacement mid-run.
    await anyio.sleep(0.1 if gang.epoch < 2 else 0.02)


async def _too_few() -> dict[str, Any]:
    import torch

    gang = await agang.init(elastic=agang.Elastic(min_size=2), timeout=60, op_timeout=OP_TIMEOUT)
    pids = await gang.all_gather_objects(os.getpid())
    if gang.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    report: dict[str, Any] = {"peer_pid": pids[1]}
    try:
        await gang.all_reduce(torch.ones(1))
    except agang.GangError:
        started = time.monotonic()
        try:
            await gang.reform(timeout=2.0)
        except agang.GangError as error:
            report.update(error=type(error).__name__, message=str(error))
        report["took"] = time.monotonic() - started
    await gang.close()
    return report


if __name__ == "__main__":
    import anyio

    program = {"train": _train, "too_few": _too_few}[sys.argv[1]]
    print("RESULT " + json.dumps(anyio.run(program)), flush=True)
