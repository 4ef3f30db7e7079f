"""Processes on the test cluster's nodes (``tests/support/netns.py``): their environment, their
output read line by line, and a probe of whether an address and port can be reached.

A rank program prints ``READY`` (or other markers) as it goes and ends with one
``RESULT <json>`` line; :class:`Lines` waits for each within a bound. Run as a script,
``python tests/support/noderun.py reach ADDRESS PORT`` prints what :func:`reach` returns.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from netns import Cluster

THIS = str(Path(__file__).resolve())
SUPPORT = Path(THIS).parent  # tests/support
ROOT = SUPPORT.parents[1]  # the repository


def node_env(**extra: str) -> dict[str, str | None]:
    """A process's environment on a node: agang importable, one compute thread, and no
    interface, launcher or store variable inherited from the test's own environment. A
    test file run there as a script imports these helpers by name: they are on its path."""
    path = os.pathsep.join([str(ROOT), str(SUPPORT)])
    env: dict[str, str | None] = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "AGANG_SOCKET_IFNAME"):
        env[name] = None  # never inherited: agang must choose by itself
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env[name] = None  # nor a launcher's variables
    for name in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        env[name] = None
    env.update(extra)
    return env


class Lines:
    """A process's output, line by line, read on a thread (bounded waits)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} line within {timeout} s:\n{''.join(self.lines)}")

    def wait_for_json(self, prefix: str, timeout: float) -> dict[str, Any]:
        """The JSON document after ``prefix`` on the first line that starts with it."""
        line = self.wait_for(prefix, timeout)
        return json.loads(line[len(prefix) :])  # type: ignore[no-any-return]

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        """The ``RESULT`` document, once the process has exited (within ``timeout``)."""
        document = self.wait_for_json("RESULT ", timeout)
        self.process.wait(timeout=timeout)
        return document


def start(cluster: Cluster, node: int, argv: Sequence[str], env: dict[str, str | None]) -> Lines:
    """Starts ``python argv...`` on ``node`` with a pipe to its stdin; ended at teardown."""
    process = cluster.popen(node, [sys.executable, *argv], env=env, stdin=subprocess.PIPE)
    return Lines(process)


def reach(address: str, port: int, timeout: float = 3.0) -> str:
    """One TCP connection to ``address:port``: "connected", "refused", or the error's name."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "refused"
    except OSError as error:
        return type(error).__name__
    return "connected"


def reach_from(cluster: Cluster, node: int, address: str, port: int) -> str:
    """:func:`reach`, from a process on ``node``."""
    probe = [sys.executable, THIS, "reach", address, str(port)]
    return cluster.run(node, probe, env=node_env(), timeout=30).stdout.strip()


if __name__ == "__main__":
    assert sys.argv[1] == "reach", sys.argv
    print(reach(sys.argv[2], int(sys.argv[3])))
