"""The multi-process NCCL tests on real NCCL, on a machine with one GPU: for correctness,
never cost. Skipped without a GPU (CI runs their cases on the simulated NCCL:
``test_sim_nccl_gangs``, ``test_elastic_sim_nccl``, ``test_weights_sim_nccl``).

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless
each claims a host of its own: every process here sets ``NCCL_HOSTID`` to its own value,
with NCCL's shared-memory and peer-to-peer transports off, so the ranks' traffic goes
over NCCL's sockets on loopback. ``bench/device_check.py`` runs this file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

import anyio
import pytest
import torch
from elasticrun import Cluster, Control
from weightfleet import ADMISSION, PUSH_TIMEOUT, START_SECONDS, push, serve
from weightserver import model

import agang
from agang.testing import WorldRunError, run_world

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Two ranks on one GPU: NCCL's socket transport only (each rank sets NCCL_HOSTID).
ONE_GPU = {"NCCL_SHM_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}
FAILURES = ("CollectiveError", "GangBrokenError", "GangTimeoutError")


@pytest.fixture
def anyio_backend() -> str:
    """asyncio alone: the device's time is short, and the loops are CI's to cover."""
    return "asyncio"


def _claim_a_host() -> None:
    os.environ.update(ONE_GPU)
    os.environ["NCCL_HOSTID"] = f"agang-test-{os.getpid()}"


def _killed_on_real_nccl() -> tuple[str, str]:
    _claim_a_host()

    async def main() -> tuple[str, str]:
        gang = await agang.init(backend="nccl", timeout=120.0, op_timeout=30.0)
        try:
            total = await gang.all_reduce(torch.ones(2, device=gang.device))
            assert total.tolist() == [3.0, 3.0], total
            if gang.rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                await gang.all_reduce(torch.ones(2, device=gang.device), timeout=5.0)
            except agang.GangError as error:
                return type(error).__name__, str(error)
            return "no error", ""
        finally:
            await gang.close()

    return anyio.run(main)


def test_a_killed_rank_fails_the_survivors_op_on_real_nccl_naming_it() -> None:
    with pytest.raises(WorldRunError) as caught:
        run_world(_killed_on_real_nccl, 3, make_gang=False, timeout=240.0)
    assert set(caught.value.failures) == {2}, caught.value.failures
    for rank in (0, 1):
        kind, message = caught.value.results[rank]
        assert kind in FAILURES, message
        assert "rank 2" in message, message


def test_an_elastic_gang_on_real_nccl_reforms_after_a_kill_and_admits_a_joiner(
    control: Control,
) -> None:
    settings = {"timeout": 120, "op_timeout": 5.0, "reform_timeout": 60.0}
    with Cluster(control, 3, env=ONE_GPU, own_hosts=True, min_size=2, **settings) as cluster:
        assert {event["backend"] for event in cluster.epochs} == {"nccl"}
        w0, w1, w2 = cluster.workers
        for worker in (w0, w1, w2):
            worker.send("all_reduce", repeat=1000)
        for worker in (w0, w1, w2):
            worker.event("issued", timeout=60)
        cluster.kill(w2)
        failures = [w.event("failed", timeout=60) for w in (w0, w1)]
        assert all(f["error"] in FAILURES for f in failures), failures
        epochs = [w.event("epoch", "reform_failed", timeout=120) for w in (w0, w1)]
        assert [(e["what"], e["epoch"], e["size"]) for e in epochs] == [("epoch", 1, 2)] * 2
        joiner = cluster.fork(2)
        cluster.join(joiner)
        for worker in (w0, w1):
            worker.send("reform", after_joiner=True)
        joined = [w.event("epoch", "reform_failed", timeout=120) for w in (w0, w1, joiner)]
        assert [(e["what"], e["epoch"], e["size"]) for e in joined] == [("epoch", 2, 3)] * 3
        for worker in (w0, w1, joiner):
            worker.send("all_reduce", repeat=3, reform_after=False)
        assert [
            w.event("reduced", "failed", timeout=60).get("exact") for w in (w0, w1, joiner)
        ] == [
            3,
            3,
            3,
        ]


@pytest.mark.anyio
async def test_weights_over_real_nccl_drop_a_killed_server_and_admit_it_again(
    started: list[subprocess.Popen[str]], store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in ONE_GPU.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NCCL_HOSTID", f"agang-test-publisher-{os.getpid()}")
    tensors = {name: tensor.cuda() for name, tensor in model(0).items()}
    publisher = await agang.WeightPublisher.open(tensors, store=store, channel="w", timeout=60)
    try:
        assert publisher.plan.transport == "nccl"

        def server(name: str) -> Any:
            env = {**ONE_GPU, "NCCL_HOSTID": f"agang-test-{name}-{time.monotonic_ns()}"}
            return serve(started, store, name, "--device", "cuda", "--timeout", "60", env=env)

        servers = [server(f"s{i}") for i in range(2)]
        pids = [s.opened() for s in servers]
        assert (await push(publisher, 1)).delivered == ("s0", "s1")
        for s in servers:
            s.received(1)
        os.kill(pids[1], signal.SIGKILL)
        report = await push(publisher, 2, timeout=max(PUSH_TIMEOUT, 10.0))
        assert set(report.dropped) == {"s1"}, report
        assert report.delivered == ("s0",), report
        servers[0].received(2)
        again = server("s1")
        again.event("opened", timeout=START_SECONDS)
        await anyio.sleep(ADMISSION)
        report = await push(publisher, 3, timeout=60.0)
        assert report.delivered == ("s0", "s1"), report
        for s in (servers[0], again):
            s.received(3)
    finally:
        await publisher.close()
