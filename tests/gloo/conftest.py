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


@pytest.fixture(scope="module")
def module_store() -> Iterator[str]:
    """One ``agang store`` for a module's tests (each opens its channels anew: a
    publisher takes a channel whose last one closed at once), ended by its pid: a store
    process costs its torch import, over a second here, at every test otherwise."""
    processes: list[subprocess.Popen[str]] = []
    server = Store(processes, "--port", "0", "--quiet")
    try:
        yield server.out.next(START_SECONDS).split()[-1]
    finally:
        for process in processes:
            process.kill()
            process.wait(timeout=30)
