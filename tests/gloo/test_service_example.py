"""examples/service.py as two real ranks: health while waiting, a sum, a stop, a failed init."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from netutil import free_port

pytestmark = pytest.mark.gloo

SERVICE = Path(__file__).resolve().parents[2] / "examples" / "service.py"


# Runs the service with torch's import held until the file named first exists (60 s at
# most): what a rank serves before that, it serves before torch is imported.
_HOLD_TORCH = """
import importlib.abc, os, runpy, sys, time
gate = sys.argv[1]
class Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            for _ in range(1200):
                if os.path.exists(gate):
                    break
                time.sleep(0.05)
        return None
sys.meta_path.insert(0, Gate())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _start(
    rank: int,
    world_size: int,
    master_port: int,
    port: int,
    *extra: str,
    hold_torch_until: Path | None = None,
) -> subprocess.Popen:
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }
    command = [sys.executable, str(SERVICE), "--port", str(port), *extra]
    if hold_torch_until is not None:
        command[1:1] = ["-c", _HOLD_TORCH, str(hold_torch_until)]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return json.loads(reply.read())


def _poll(port: int, done: Any, bound: float, what: str) -> dict[str, Any]:
    """Polls /health until ``done(body)``, at most ``bound`` seconds (every 50 ms)."""
    deadline = time.monotonic() + bound
    last: object = None
    for _ in range(int(bound / 0.05) + 1):
        try:
            last = _get(port, "/health")
            if done(last):
                return last  # type: ignore[return-value]
        except (urllib.error.URLError, ConnectionError) as error:
            last = error
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"{what} not seen on port {port} within {bound} s; last: {last!r}")


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_service_starts_sums_and_stops(tmp_path: Path) -> None:
    master_port, port0, port1 = free_port(), free_port(), free_port()
    torch_may_import = tmp_path / "torch-may-import"
    procs = [_start(0, 2, master_port, port0, hold_torch_until=torch_may_import)]
    try:
        # It answers before torch is even imported: while torch's import is held (not
        # within a time, which a loaded machine's start-up of Python alone can pass).
        health = _poll(port0, lambda body: True, 60.0, "any health")
        assert health == {"status": "starting", "rank": 0, "world_size": 2, "error": None}
        torch_may_import.touch()

        procs.append(_start(1, 2, master_port, port1))
        for port in (port0, port1):
            health = _poll(port, lambda body: body["status"] != "starting", 60.0, "ready")
            assert health["status"] == "ready", health

        assert _get(port0, "/sum?value=1.5") == {"value": 1.5, "sum": 2.5, "world_size": 2}
        assert _get(port0, "/sum?value=-4") == {"value": -4.0, "sum": -3.0, "world_size": 2}
        assert _get(port0, "/stop") == {"status": "stopping"}
        codes = [proc.wait(10) for proc in procs]
        assert codes == [0, 0], [proc.stderr.read().decode() for proc in procs]  # type: ignore[union-attr]
    finally:
        _stop(*procs)


def test_service_reports_missing_rank_and_exits_1() -> None:
    master_port, port0 = free_port(), free_port()
    # 6 s to set up: on a loaded machine (a CI run that took 10 min) 3 s ran out before
    # rank 0 waited for its peers, so the error could not name the missing rank.
    proc = _start(0, 2, master_port, port0, "--timeout", "6", "--linger", "2")
    try:
        health = _poll(port0, lambda body: body["status"] == "failed", 30.0, "failed")
        assert health.get("missing_ranks") == [1], health
        assert "Missing ranks: [1]" in health["error"], health
        failed_at = time.monotonic()
        assert proc.wait(10) == 1
        assert time.monotonic() - failed_at > 1.0  # it lingered, serving "failed"
    finally:
        _stop(proc)
