"""Running an example script to its end from a test, and checking its processes ended.

The scripts start their own ``agang store`` and workers and end them by pid; a test ends
the script by pid if it outlives its timeout (SIGTERM, which it handles by ending its
processes, then SIGKILL), and checks that every process the script says it started is
gone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from storeutil import clean_env

ROOT = Path(__file__).resolve().parents[2]


def run_script(
    script: Path, arguments: list[str], timeout: float, *, grace: float = 20.0
) -> subprocess.CompletedProcess[str]:
    """Runs ``script``; past ``timeout`` it is sent SIGTERM, then after ``grace`` s
    SIGKILL, by pid, and the test fails with what it printed."""
    process = subprocess.Popen(
        [sys.executable, str(script), *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
        cwd=ROOT,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            out, err = process.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=10)
        pytest.fail(f"{script.name} ran past {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def alive(pid: int) -> bool:
    """Whether a process of ``pid`` exists."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 0)
        return True
    return False


def load_script(script: Path) -> ModuleType:
    """``script`` imported as a module of its own name, to call its parts."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


def ended_pids(stdout: str) -> list[int]:
    """The pids a script says it started and ended ("processes started and ended: ...")."""
    ended = re.search(r"processes started and ended: ([\d ]+)", stdout)
    assert ended is not None, stdout
    return [int(pid) for pid in ended.group(1).split()]
