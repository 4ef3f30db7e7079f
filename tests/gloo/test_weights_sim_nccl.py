"""Weights to a changing fleet over NCCL, on the simulated NCCL across processes
(``AGANG_SIM_NCCL=1``): the publisher (this test's process) and the servers (processes of
``tests/support/weightserver.py``) each run their epochs' rounds over an NCCL group of
their own, never a default group, on their process's simulated device.

What NCCL changes is tested here: the channel's transport is NCCL on both sides, a
server killed mid-push leaves the survivors' kernels waiting until the round's deadline
aborts that communicator (a dead peer is not seen at once, as on Gloo), the next round
runs on a new communicator, and a server whose tensors would take Gloo is refused at
open, naming both transports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from datetime import timedelta

import anyio
import pytest
import torch.distributed as dist
from weightfleet import (
    PUSH_TIMEOUT,
    RECOVERY,
    SLACK,
    START_SECONDS,
    open_publisher,
    push,
    serve,
    until_pending,
)

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]

SIM = {"AGANG_SIM_NCCL": "1"}


@pytest.fixture(autouse=True)
def simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's channels move CPU tensors over the simulated NCCL, for this test."""
    monkeypatch.setenv("AGANG_SIM_NCCL", "1")


async def test_every_push_over_nccl_is_exact_and_a_killed_server_is_dropped_then_readmitted(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        assert publisher.plan.transport == "nccl-sim"
        servers = [serve(started, store, f"s{i}", env=SIM) for i in range(3)]
        pids = [server.opened() for server in servers]
        assert (await push(publisher, 1)).delivered == ("s0", "s1", "s2")
        for server in servers:
            server.received(1)
        os.kill(pids[1], signal.SIGKILL)
        report = await push(publisher, 2, timeout=PUSH_TIMEOUT)
        print(f"SIGKILL mid-push, simulated NCCL: {report}")
        assert set(report.dropped) == {"s1"}, report
        assert report.dropped["s1"].startswith("no answer (dead, stopped"), report
        assert report.delivered == ("s0", "s2"), report
        assert report.seconds < PUSH_TIMEOUT + RECOVERY + SLACK, report
        for server in (servers[0], servers[2]):
            server.received(2)
        again = serve(started, store, "s1", env=SIM)  # restarted under its name
        again.opened()
        await until_pending(publisher, "s1")
        report = await push(publisher, 3)
        assert report.delivered == ("s0", "s1", "s2"), report
        assert report.dropped == {}, report
        for server in (servers[0], servers[2], again):
            server.received(3)
    finally:
        await publisher.close()
    # Every epoch's communicator was shut down: its wire's threads are gone.
    assert await _wire_threads_after(10.0) == []
    # The epochs' NCCL groups (their wires' Gloo keys) leave nothing in the store.
    keys = _keys(store)
    print(f"the store after close: {keys}")
    assert [key for key in keys if "/wire/" in key or key.endswith("/0")] == [], keys


async def _wire_threads_after(seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("agang-sim-nccl-wire")]
        if not alive or time.monotonic() > deadline:
            return alive
        await anyio.sleep(0.05)


def _keys(address: str) -> list[str]:
    host, port = address.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    return sorted(client.list_keys())


async def test_a_server_whose_tensors_take_gloo_is_refused_naming_both_transports(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        good = serve(started, store, "good", env=SIM)
        gloo = serve(started, store, "gloo", env={"AGANG_SIM_NCCL": "0"})
        good.opened()
        refused = gloo.event("refused", "opened", timeout=START_SECONDS)
        assert refused["error"] == "ValueError", refused
        message = refused["message"]
        assert "moves them over nccl-sim, and tensors here move over gloo" in message, message
        report = await push(publisher, 1)
        assert report.delivered == ("good",), report
        good.received(1)
    finally:
        await publisher.close()
