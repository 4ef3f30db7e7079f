"""An NCCL error under torchrun reaches the program instead of killing it.

torchrun's agent sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (tear down) in every worker;
``agang.init`` replaces that default with 2 unless ``AGANG_KEEP_NCCL_SETTINGS=1``
(``agang._setup.process``). Each case is a process that looks like a torchrun worker,
applies agang's NCCL settings as ``agang.init`` does, and meets an asynchronous NCCL error
on the simulated NCCL, which tears the process down under 1 or 3 as c10d's watchdog does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gloo  # runs processes

PROGRAM = textwrap.dedent(
    """
    import asyncio, os, torch, agang
    from agang._setup.process import apply_nccl_settings
    from agang.testing import SimulatedNccl

    apply_nccl_settings(os.environ)  # what agang.init does on NCCL
    print("mode", os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"], flush=True)

    async def main():
        with SimulatedNccl(2) as sim:
            gangs = sim.gangs()
            sim.fail_next()
            handles = [gang.all_reduce(torch.ones(2)) for gang in gangs]
            for handle in handles:
                try:
                    await handle
                except agang.CollectiveError:
                    print("raised", flush=True)
            for gang in gangs:
                await gang.close()

    asyncio.run(main())
    """
)


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    # What torchrun's agent gives every worker.
    environ |= {"TORCHELASTIC_RUN_ID": "job", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env=environ, capture_output=True, text=True, timeout=60
    )


def test_under_torchruns_default_the_error_is_raised_and_the_process_lives() -> None:
    result = _run()

    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["mode 2", "raised", "raised"]


def test_a_kept_tear_down_mode_ends_the_process_as_c10d_would() -> None:
    result = _run(AGANG_KEEP_NCCL_SETTINGS="1")

    assert result.returncode == -signal.SIGABRT
    assert result.stdout.startswith("mode 1\n")
    assert "raised" not in result.stdout
    assert "tears the process down" in result.stderr
