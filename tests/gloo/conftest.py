"""Fixtures of the weights tests (``test_weights*.py``): the processes a test starts,
and an ``agang store`` on 127.0.0.1 for its channel."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
from storeutil import Store
from weightfleet import START_SECONDS


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The processes a test starts; each is ended by its pid at the end."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture
def store(started: list[subprocess.Popen[str]]) -> str:
    server = Store(started, "--port", "0", "--quiet")
    return server.out.next(START_SECONDS).split()[-1]
