"""agang's NCCL path across processes, on the simulated NCCL (``AGANG_SIM_NCCL=1``).

Each rank is a process whose ``agang.init`` makes its world over the ``agang_sim_nccl``
c10d backend: the gang's kind is ``"nccl"``, its device the CPU, and every NCCL path of
agang (polled completion, stream order, abort as NCCL's, lanes and sub-gangs) runs. A
user's program runs unchanged under torchrun with the variable set.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from storeutil import clean_env

from agang import Gang
from agang.testing import WorldRunError, run_world

pytestmark = pytest.mark.gloo

ROOT = Path(__file__).resolve().parents[2]
SIM = {"AGANG_SIM_NCCL": "1"}


async def _tour(gang: Gang) -> dict[str, Any]:
    rank, size = gang.rank, gang.size
    total = await gang.all_reduce(torch.full((3,), float(rank + 1)))
    gathered = await gang.all_gather(torch.empty(size, 2), torch.full((2,), float(rank)))
    copied = await gang.broadcast(torch.full((2,), float(rank)), source_rank=1)
    peer = 1 - rank
    received = torch.zeros(3)
    await gang.exchange(sends=[(torch.full((3,), float(rank)), peer)], recvs=[(received, peer)])
    await gang.barrier()
    sub = await gang.create_gang([0, 1])
    assert sub is not None
    in_sub = await sub.all_reduce(torch.ones(2))
    lane = await gang.lane("io", high_priority=True)
    in_lane = await lane.all_reduce(torch.full((1,), float(rank)))
    await sub.close()
    await lane.close()
    return {
        "backend": gang.backend,
        "device": str(gang.device),
        "total": total.tolist(),
        "gathered": gathered[:, 0].tolist(),
        "copied": copied.tolist(),
        "received": received.tolist(),
        "sub": in_sub.tolist(),
        "lane": in_lane.tolist(),
    }


def test_a_world_on_the_simulation_runs_agang_s_nccl_path() -> None:
    # No backend named: the simulation makes "nccl" the default on a machine without CUDA.
    # One loop (trio): what the processes add is the c10d backend and the device; the
    # NCCL path's loop side (polled completion) runs on all three in tests/world.
    results = run_world(
        _tour,
        2,
        backend=None,
        async_backend="trio",
        env=SIM,
        timeout=90.0,  # type: ignore[arg-type]
    )
    for rank, seen in enumerate(results):
        assert seen == {
            "backend": "nccl",
            "device": "cpu",
            "total": [3.0, 3.0, 3.0],
            "gathered": [0.0, 1.0],
            "copied": [1.0, 1.0],
            "received": [float(1 - rank)] * 3,
            "sub": [2.0, 2.0],
            "lane": [1.0],
        }, rank


async def _killed(gang: Gang, signum: int = signal.SIGKILL) -> tuple[str, str, float]:
    await gang.all_reduce(torch.ones(2))
    if gang.rank == 2:
        if signum == signal.SIGSTOP:  # woken 4 s later, long after its peers gave up
            subprocess.Popen(["sh", "-c", f"sleep 4; kill -CONT {os.getpid()}"])  # noqa: ASYNC220  # returns at once
        os.kill(os.getpid(), signum)
    started = time.monotonic()
    try:
        await gang.all_reduce(torch.ones(2), timeout=1.0)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_killed_or_stopped_rank_fails_the_survivors_op_at_its_deadline_naming_it(
    signum: int,
) -> None:
    # NCCL's kernels wait for a dead or stopped peer (not seen at once, as a kill is on
    # Gloo): the survivors' deadline ends the op, and blame finds who does not answer.
    run = functools.partial(_killed, signum=signum)
    if signum == signal.SIGKILL:
        with pytest.raises(WorldRunError) as caught:
            run_world(run, 3, backend="nccl", env=SIM, timeout=90.0)
        assert set(caught.value.failures) == {2}, caught.value.failures
        results = caught.value.results
    else:  # the woken rank finds its gang given up on, and says so
        results = dict(enumerate(run_world(run, 3, backend="nccl", env=SIM, timeout=90.0)))
        assert results[2][0] in ("GangTimeoutError", "GangBrokenError", "CollectiveError")
    for rank in (0, 1):
        kind, message, seconds = results[rank]
        assert kind == "GangTimeoutError", message
        assert "rank 2 (" in message, message
        assert "no answer (dead, stopped, or cut off from the store)" in message, message
        assert seconds < 10.0, seconds  # the 1 s deadline, then blame


def test_a_two_process_program_runs_under_torchrun_on_the_simulation() -> None:
    env = clean_env() | SIM
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*run, str(ROOT / "examples" / "hello.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "agang hello: 2 rank(s) on nccl" in done.stdout, done.stdout
    assert "all_reduce of 1..2: 3 (expected 3)" in done.stdout, done.stdout


def _wrapped() -> tuple[str, list[float]]:
    """A world the program made on the simulation itself, then wrapped by agang.init
    (without the variable): agang must run it as NCCL, not trust Work futures as Gloo's."""
    import anyio
    import torch.distributed as dist

    import agang
    from agang.testing import use_simulated_nccl

    dist.init_process_group(use_simulated_nccl())

    async def main() -> tuple[str, list[float]]:
        gang = await agang.init(timeout=60.0, op_timeout=30.0)
        try:
            total = await gang.all_reduce(torch.full((4,), float(gang.rank + 1)))
            return gang.backend, total.tolist()
        finally:
            await gang.close()

    return anyio.run(main)


def test_a_world_made_on_the_simulation_is_wrapped_as_nccl() -> None:
    results = run_world(_wrapped, 2, make_gang=False, timeout=90.0)
    assert results == [("nccl", [3.0] * 4)] * 2
