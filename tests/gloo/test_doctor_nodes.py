"""``agang doctor`` across nodes: run on node 1 as rank 1 of 2, against node 0's store port.

Node 0 holds a plain listening socket at MASTER_PORT on its data address (no rank 0 is
needed: the doctor only connects). The doctor then runs on node 1 (``tests/support/netns.py``)
four times, as ``python -m agang doctor --json``:

- reachable: MASTER_ADDR is node 0's data address; everything is fine (exit 0), and the
  findings name data1, node 1's interface toward it;
- node 1's data link down: the port is unreachable from data1, which is down; the
  doctor says what to fix (exit 1);
- node 0's data link down (the cut is on the far side, so data1 is up): no answer in time
  from data1 (exit 1);
- the hostname trap: MASTER_ADDR is a name node 1's hosts file maps to loopback; the
  doctor says so, and nothing about a port at loopback (exit 1).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from netns import Cluster
from noderun import node_env

LISTEN = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "s.bind((sys.argv[1], int(sys.argv[2])))\n"
    "s.listen(16)\n"
    "print('LISTENING', flush=True)\n"
    "time.sleep(120)\n"
)


def _doctor(cluster: Cluster, master_addr: str, port: int) -> subprocess.Popen[str]:
    """``agang doctor --json`` on node 1, as rank 1 of 2 (one rank per node)."""
    env = node_env(
        RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=master_addr, MASTER_PORT=str(port),
    )  # fmt: skip
    # 2 s: a resolve or connect the machine's load slows is not the failure tested.
    argv = [sys.executable, "-m", "agang", "doctor", "--json", "--timeout", "2.0"]
    return cluster.popen(1, argv, env=env, stderr=subprocess.PIPE)


def _report(process: subprocess.Popen[str]) -> dict[str, Any]:
    output, errors = process.communicate(timeout=60)
    document: dict[str, Any] = json.loads(output)
    document["code"] = process.returncode
    document["stderr"] = errors
    return document


@pytest.fixture(scope="module")
def reports(netns: None) -> dict[str, dict[str, Any]]:
    with Cluster(num_nodes=2, own_name_on_loopback=True) as cluster:
        address = cluster.nodes[0].address("data")
        port = cluster.free_port(0)
        listener = cluster.popen(0, [sys.executable, "-c", LISTEN, address, str(port)])
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "LISTENING"
        reachable = _doctor(cluster, address, port)
        trap = _doctor(cluster, "agnode1", port)  # node 1's own name: loopback there
        found = {"reachable": _report(reachable), "trap": _report(trap)}
        cluster.link_down(1, "data")
        found["own link down"] = _report(_doctor(cluster, address, port))
        cluster.link_up(1, "data")
        cluster.link_down(0, "data")
        found["far link down"] = _report(_doctor(cluster, address, port))
    for name, document in found.items():
        print(f"-- {name}: exit {document['code']}")
        for finding in _network(document):
            print(f"{finding['status']:<8} {finding['check']}: {finding['seen']}")
            print(f"         causes: {finding['causes']}\n         fix: {finding['fix']}")
    return found


def _network(document: dict[str, Any]) -> list[dict[str, Any]]:
    checks = ("MASTER_ADDR", "MASTER_PORT", "interface")
    return [finding for finding in document["findings"] if finding["check"] in checks]


def _one(document: dict[str, Any], check: str, status: str) -> dict[str, Any]:
    findings: list[dict[str, Any]] = document["findings"]
    matches = [f for f in findings if f["check"] == check and f["status"] == status]
    assert len(matches) == 1, json.dumps(document, indent=2)
    return matches[0]


def test_a_reachable_store_port_is_fine_and_names_the_interface(
    reports: dict[str, dict[str, Any]],
) -> None:
    document = reports["reachable"]

    assert document["code"] == 0, document
    assert document["problems"] == 0, document
    assert _one(document, "MASTER_ADDR", "ok")["seen"] == "'10.201.0.1' resolves to 10.201.0.1."
    port = _one(document, "MASTER_PORT", "ok")["seen"]
    assert "is reachable from data1" in port, port
    assert "agang will use data1" in _one(document, "interface", "ok")["seen"]


def test_a_down_link_on_this_node_is_named_with_what_to_fix(
    reports: dict[str, dict[str, Any]],
) -> None:
    document = reports["own link down"]

    assert document["code"] == 1, document
    port = _one(document, "MASTER_PORT", "problem")
    assert "from data1" in port["seen"], port
    interface = _one(document, "interface", "problem")
    assert "data1" in interface["seen"], interface
    assert "is down" in interface["seen"], interface
    assert "ip link" in interface["fix"], interface
    assert "AGANG_SOCKET_IFNAME" in interface["fix"], interface


def test_a_link_cut_on_the_far_side_is_no_answer_from_this_nodes_interface(
    reports: dict[str, dict[str, Any]],
) -> None:
    document = reports["far link down"]

    assert document["code"] == 1, document
    port = _one(document, "MASTER_PORT", "problem")
    assert "No answer from 10.201.0.1:" in port["seen"], port
    assert "from data1" in port["seen"], port
    assert any("link" in cause for cause in port["causes"]), port
    assert "agang will use data1" in _one(document, "interface", "ok")["seen"]


def test_a_name_that_means_loopback_on_this_node_is_the_problem_named(
    reports: dict[str, dict[str, Any]],
) -> None:
    document = reports["trap"]

    assert document["code"] == 1, document
    problem = _one(document, "MASTER_ADDR", "problem")
    assert "'agnode1' resolves to the loopback address 127.0.1.1" in problem["seen"], problem
    assert any("/etc/hosts" in cause for cause in problem["causes"]), problem
    # Nothing about a port or an interface at loopback: that would send the reader astray.
    assert [f["check"] for f in _network(document)] == ["MASTER_ADDR", "MASTER_ADDR"], document
