"""One program, many machines: real Gloo ranks on separate network namespaces ("nodes").

Every node (``tests/support/netns.py``) has its own addresses on private switched networks, and
its hostname resolves to loopback, as on many real machines: a rank that advertised the
address its hostname resolves to could never be reached. Nothing here sets
``GLOO_SOCKET_IFNAME``: agang must find the interface that reaches ``MASTER_ADDR`` itself.

The ranks' own programs are in this file too (``python tests/gloo/test_many_hosts.py PROGRAM``);
each prints ``READY`` when its gang is up, may wait for a line on stdin, and ends with one
``RESULT <json>`` line. Bounds on time keep a wide margin between pass and fail.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Cluster
from noderun import ROOT, node_env, reach_from, start

pytestmark = pytest.mark.gloo

THIS = str(Path(__file__).resolve())
OP_TIMEOUT = 3.0
BIG = 4 * 1024 * 1024  # floats: one all-reduce of 16 MiB


def _plain_env(cluster: Cluster, rank: int, size: int, port: int) -> dict[str, str | None]:
    """One rank per node, launched without torchrun: the store is agang's own."""
    return node_env(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=cluster.nodes[0].address("data"), MASTER_PORT=str(port),
    )  # fmt: skip


def _torchrun(
    cluster: Cluster,
    node: int,
    port: int,
    nproc: int,
    script: list[str],
    *,
    local_addr: bool = True,
) -> subprocess.Popen[str]:
    """torchrun's c10d rendezvous across the cluster, hosted by node 0.

    Where a node's hostname resolves to loopback, torchrun needs two flags to work across
    machines: ``is_host`` on the node that hosts the rendezvous (its heuristic compares
    the endpoint with the hostname's addresses) and ``--local-addr`` (else it tells the
    workers to meet at ``localhost``). Both are about torchrun, not agang.
    """
    host = ["--rdzv-conf", "is_host=1"] if node == 0 else []
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(cluster.nodes)),
        "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-id", "agang-test",
        "--rdzv-endpoint", f"{cluster.nodes[0].address('data')}:{port}", *host,
        "--max-restarts", "0",
    ]  # fmt: skip
    if local_addr:
        argv += ["--local-addr", cluster.nodes[node].address("data")]
    return cluster.popen(node, [*argv, *script], env=node_env())


def _finish(processes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outputs = []
    for node, process in enumerate(processes):
        output, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"node {node} exited {process.returncode}:\n{output}"
        outputs.append(output)
    return outputs


def test_torchrun_runs_hello_on_two_nodes_of_two_ranks(netns: None) -> None:
    with Cluster(num_nodes=2) as cluster:
        port = cluster.free_port(0)
        script = [str(ROOT / "examples" / "hello.py")]
        processes = [_torchrun(cluster, node, port, 2, script) for node in (0, 1)]
        outputs = _finish(processes, timeout=90)

    assert "agang hello: 4 rank(s) on gloo" in outputs[0], outputs[0]
    assert "all_reduce of 1..4: 10 (expected 10)" in outputs[0], outputs[0]


def test_torchrun_without_local_addr_fails_at_once_saying_so(netns: None) -> None:
    """Without --local-addr, torchrun hands every worker MASTER_ADDR=localhost (the
    hostname's loopback name): agang must refuse it at once, not wait out its deadline."""
    with Cluster(num_nodes=2) as cluster:
        port = cluster.free_port(0)
        script = [str(ROOT / "examples" / "hello.py")]
        started = time.monotonic()
        processes = [_torchrun(cluster, n, port, 1, script, local_addr=False) for n in (0, 1)]
        outputs = [process.communicate(timeout=90)[0] for process in processes]
        elapsed = time.monotonic() - started

    print(f"both nodes failed within {elapsed:.1f} s, init after {_init_seconds(outputs)} s")
    assert all(process.returncode != 0 for process in processes), outputs
    assert elapsed < 45, elapsed  # torchrun's own start and end included
    for output in outputs:
        assert "resolves to the loopback address" in output, output
        assert "--local-addr" in output, output
    assert max(_init_seconds(outputs)) < 6, outputs  # hello.py's init deadline is 60 s


def _init_seconds(outputs: list[str]) -> list[float]:
    """How long each failed init took, by its own account ("(after 0.1 s, ...")."""
    found = [
        re.findall(r"\(after ([0-9.]+) s, (?:\d+ attempt\(s\), )?deadline", output)
        for output in outputs
    ]
    assert all(found), outputs
    return [float(seconds) for per_output in found for seconds in per_output]


def test_the_trainer_matches_ddp_across_two_nodes(netns: None) -> None:
    with Cluster(num_nodes=2) as cluster:
        port = cluster.free_port(0)
        script = [
            str(ROOT / "examples" / "async_trainer.py"), "--check-ddp", "--steps", "10",
            "--hidden", "32", "--layers", "2", "--no-progress",
        ]  # fmt: skip
        processes = [_torchrun(cluster, node, port, 1, script) for node in (0, 1)]
        outputs = _finish(processes, timeout=90)

    print(outputs[0])
    assert "agang: 2 rank(s), 10 steps" in outputs[0], outputs[0]
    assert "DDP check passed: 10 losses and all parameters match" in outputs[0], outputs[0]


def test_slurm_style_ranks_find_the_store_host_by_node_name(netns: None) -> None:
    """No torchrun, no MASTER_ADDR: the first host of SLURM_JOB_NODELIST hosts the store."""
    job_id = str(random.randrange(1, 10**6))
    with Cluster(num_nodes=2) as cluster:
        processes = []
        for rank in range(4):
            node, local = divmod(rank, 2)
            env = node_env(
                SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node), SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID=job_id,
                SLURM_JOB_NODELIST="agnode[0-1]", SLURM_NNODES="2",
            )  # fmt: skip
            hello = [sys.executable, str(ROOT / "examples" / "hello.py")]
            processes.append(cluster.popen(node, hello, env=env))
        outputs = _finish(processes, timeout=90)

    assert "agang hello: 4 rank(s) on gloo" in outputs[0], outputs[0]
    assert "all_reduce of 1..4: 10 (expected 10)" in outputs[0], outputs[0]


def test_a_store_host_whose_own_name_means_loopback_fails_at_once(netns: None) -> None:
    """Debian's hosts file maps a node's own name to 127.0.1.1: under SLURM, the first
    node's ranks then meet at loopback while the others look for its real address.
    Rank 0 must say so at once rather than wait out its 60 s deadline."""
    with Cluster(num_nodes=2, own_name_on_loopback=True) as cluster:
        env = node_env(
            SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0",
            SLURM_NTASKS_PER_NODE="1", SLURM_JOB_ID=str(random.randrange(1, 10**6)),
            SLURM_JOB_NODELIST="agnode[0-1]",
        )  # fmt: skip
        started = time.monotonic()
        done = cluster.run(0, [sys.executable, str(ROOT / "examples" / "hello.py")], env=env)
        elapsed = time.monotonic() - started

    print(f"rank 0 failed after {elapsed:.1f} s, init after {_init_seconds([done.stdout])} s")
    assert done.returncode != 0, done.stdout
    assert max(_init_seconds([done.stdout])) < 6, done.stdout  # the deadline is 60 s
    assert elapsed < 45, elapsed
    assert "GangInitError" in done.stdout, done.stdout
    assert "'agnode0' resolves to the loopback address 127.0.1.1" in done.stdout, done.stdout


NO_ANSWER = "no answer (dead, stopped, or cut off from the store)"


def test_a_cut_link_fails_every_rank_within_the_op_timeout(netns: None) -> None:
    with Cluster(num_nodes=2) as cluster:
        port = cluster.free_port(0)
        ranks = [
            start(cluster, r, [THIS, "link_cut"], _plain_env(cluster, r, 2, port)) for r in (0, 1)
        ]
        for lines in ranks:
            lines.wait_for("READY", timeout=60)
        time.sleep(0.5)  # ops flowing on both ranks
        cut = time.time()  # one clock: the nodes share this machine's kernel
        cluster.link_down(1, "data")
        results = [lines.result(timeout=OP_TIMEOUT + 30) for lines in ranks]

    for rank, result in enumerate(results):
        detected = result["failed_at"] - cut
        print(f"rank {rank}: failed {detected:.2f} s after the cut: {json.dumps(result)}")
        assert result["ops_before"] > 5, result
        assert result["error"] in ("GangTimeoutError", "CollectiveError", "GangBrokenError"), result
        assert 0 < detected < OP_TIMEOUT + 5, (rank, detected, result)
        assert result["max_lag"] < 0.5, result  # the loop never stalled meanwhile
        assert result["close_seconds"] < 10, result
    # The error names who is unreachable, and where: node 0 (the store's) asked rank 1,
    # which gave no answer, and names it with its node's address; node 1, cut off from
    # the store, could ask nobody, and names the store's node.
    node0, node1 = (cluster.nodes[n].address("data") for n in (0, 1))
    if results[0]["error"] == "GangTimeoutError":
        assert results[0]["peers"] == {"1": NO_ANSWER}, results[0]
        assert "rank 1 (" in results[0]["message"], results[0]
        assert f" {node1}, pid " in results[0]["message"], results[0]
    if results[1]["error"] == "GangTimeoutError":
        assert f"the store at {node0}:{port} did not answer" in results[1]["message"], results[1]


def test_collectives_take_the_network_of_master_addr_and_the_store_listens_only_there(
    netns: None,
) -> None:
    with Cluster(num_nodes=2, networks=("data", "mgmt")) as cluster:
        port = cluster.free_port(0)
        ranks = [
            start(cluster, r, [THIS, "traffic"], _plain_env(cluster, r, 2, port)) for r in (0, 1)
        ]
        for rank in ranks:
            rank.wait_for("READY", timeout=60)

        # The store agang hosts on rank 0: reachable on MASTER_ADDR's address only.
        reach = {
            "data": reach_from(cluster, 1, cluster.nodes[0].address("data"), port),
            "mgmt": reach_from(cluster, 1, cluster.nodes[0].address("mgmt"), port),
            "loopback": reach_from(cluster, 0, "127.0.0.1", port),
        }

        before = [{net: cluster.counters(n, net) for net in ("data", "mgmt")} for n in (0, 1)]
        for rank in ranks:
            rank.send("big")
        for rank in ranks:
            rank.wait_for("BIG DONE", timeout=30)
        after = [{net: cluster.counters(n, net) for net in ("data", "mgmt")} for n in (0, 1)]

        # With the other network down, collectives go on.
        for node in (0, 1):
            cluster.link_down(node, "mgmt")
        for rank in ranks:
            rank.send("small")
        results = [rank.result(timeout=30) for rank in ranks]

    print(f"store reachable from node 1 / node 0: {reach}")
    assert reach == {"data": "connected", "mgmt": "refused", "loopback": "refused"}, reach
    payload = 4 * BIG * 4  # bytes: four all-reduces of 16 MiB
    for node in (0, 1):
        sent = {
            net: after[node][net]["tx_bytes"] - before[node][net]["tx_bytes"] for net in after[node]
        }
        print(f"node {node}: bytes sent during 4 all-reduces of 16 MiB: {sent}")
        assert sent["data"] > payload / 2, sent  # a 2-rank all-reduce sends about its size
        assert sent["mgmt"] < 100_000, sent
    for result in results:
        assert result["big"] == [2.0, 2.0], result
        assert result["small"] == [3.0], result


# -- the ranks' programs ----------------------------------------------------------------------


async def _link_cut() -> dict[str, Any]:
    """All-reduces in a loop until one fails; a ticker measures the loop's lag meanwhile."""
    import anyio
    import torch

    import agang

    gang = await agang.init(timeout=60, op_timeout=OP_TIMEOUT)
    await gang.all_reduce(torch.ones(4))
    print("READY", flush=True)
    lags: list[float] = []
    done = anyio.Event()
    report: dict[str, Any] = {"ops_before": 0, "error": None}

    async def ticker() -> None:
        while not done.is_set():
            before = time.monotonic()
            await anyio.sleep(0.01)
            lags.append(time.monotonic() - before - 0.01)

    async def work() -> None:
        ends = time.monotonic() + 60
        while time.monotonic() < ends:
            try:
                await gang.all_reduce(torch.ones(1024))
            except agang.GangError as error:
                report.update(failed_at=time.time(), error=type(error).__name__)
                report["message"] = str(error)
                report["peers"] = getattr(error, "peers", {})
                break
            report["ops_before"] += 1
            await anyio.sleep(0.01)
        done.set()

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        group.start_soon(work)
    started = time.monotonic()
    with anyio.fail_after(30):
        await gang.close()
    report["close_seconds"] = time.monotonic() - started
    report["max_lag"] = max(lags)
    return report


async def _traffic() -> dict[str, Any]:
    """Waits for "big" (four 16 MiB all-reduces), then for "small" (one more op)."""
    import anyio
    import torch

    import agang

    gang = await agang.init(timeout=60, op_timeout=30)
    report: dict[str, Any] = {}
    try:
        await gang.barrier()
        print("READY", flush=True)
        assert (await anyio.to_thread.run_sync(sys.stdin.readline)).strip() == "big"
        for _ in range(4):
            total = await gang.all_reduce(torch.ones(BIG))
        report["big"] = total[:2].tolist()
        print("BIG DONE", flush=True)
        assert (await anyio.to_thread.run_sync(sys.stdin.readline)).strip() == "small"
        report["small"] = (await gang.all_reduce(torch.tensor([1.0 + gang.rank]))).tolist()
    finally:
        await gang.close()
    return report


if __name__ == "__main__":
    import anyio

    program = {"link_cut": _link_cut, "traffic": _traffic}[sys.argv[1]]
    print("RESULT " + json.dumps(anyio.run(program)), flush=True)
