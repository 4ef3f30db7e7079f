"""A process using agang exits cleanly however its threads are busy (``agang._runtime.threads``).

Each case is a small program run as a subprocess; several copies run at once, which
loads the machine the way that made the races show. Before exit quiesced agang's
threads, the deadline program aborted at exit now and then under such load ("terminate
called without an active exception": the timer thread, having woken the main thread,
was still freeing a tensor when the interpreter finalized).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

COPIES = 4
PATIENCE = 60.0

# The main thread waits for an op that only its deadline ends; the timer thread ends it,
# wakes the main thread and goes on freeing the op's references while the main thread
# returns, and the interpreter exits at once.
DEADLINE_THEN_EXIT = """
    import asyncio, torch, agang
    from agang.testing import FakeWorld

    world = FakeWorld(2, op_timeout=0.2)

    async def issue():
        return world[0].all_reduce(torch.ones(1))  # rank 1 never joins

    handle = asyncio.run(issue())
    try:
        handle.wait(timeout=30)
    except agang.GangTimeoutError:
        print("timed out as expected")
"""


def _run_copies(program: str, copies: int = COPIES) -> list[subprocess.CompletedProcess[str]]:
    source = textwrap.dedent(program)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", source],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(copies)
    ]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        results.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return results


def test_a_deadline_fired_just_before_exit_leaves_a_clean_exit() -> None:
    for result in _run_copies(DEADLINE_THEN_EXIT):
        assert result.returncode == 0, result.stderr
        assert "timed out as expected" in result.stdout
        assert "terminate called" not in result.stderr
        assert "still busy" not in result.stderr  # every agang thread was idle in time


# A rank whose store host never comes: init fails at its deadline while its store probes
# (a port derived from SLURM_JOB_ID, so several candidates) are still retrying in c10d.
INIT_FAILED_THEN_EXIT = """
    import asyncio, os, random, agang
    os.environ.update(
        SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1",
        SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(random.randrange(10_000, 60_000)),
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    try:
        asyncio.run(agang.init(timeout=2))
    except agang.GangInitError:
        print("init failed as expected")
"""


def test_an_init_that_failed_at_its_deadline_leaves_a_clean_exit() -> None:
    """Before, every such exit aborted (exit code 134): the set-up threads were not joined
    and came back from c10d's C++ while the interpreter finalized."""
    for result in _run_copies(INIT_FAILED_THEN_EXIT, copies=2):
        assert result.returncode == 0, result.stderr[-2000:]
        assert "init failed as expected" in result.stdout
        assert "terminate called" not in result.stderr
