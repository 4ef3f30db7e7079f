"""``agang store``: a rendezvous store in a process of its own, outliving every rank.

One scenario runs once (``scenario``) and the tests assert on its parts: a store on
``--port 0``, a client that joins and leaves it, two agang ranks that meet on it as on
torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), the store serving on after
they exited, a second run of the job on it, and SIGTERM and SIGINT each stopping a store.
A namespace test checks that it listens on the one address it was given.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from netns import Cluster, clean_leftovers, require_netns
from netutil import rank_env
from storeutil import Lines, Store, clean_env

from agang.__main__ import main

pytestmark = pytest.mark.gloo

ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"agang store listening on (\S+):(\d+)")
STOP_BOUND = 5.0  # seconds; typically about 0.5 (most of it the interpreter's exit)

# Ranks start (and import torch) while the store starts; the store's port comes on stdin.
_RANK = """
import json, os, sys
import torch
import agang
os.environ["MASTER_PORT"] = sys.stdin.readline().strip()
gang = agang.init_sync(in_process=False, timeout=30, op_timeout=30)
rank = gang.rank
tensor = torch.full((4,), float(rank + 1))
gang.all_reduce(tensor).wait(timeout=30)
gang.close_sync()
print("RESULT", json.dumps({"rank": rank, "sum": tensor.tolist()}), flush=True)
"""

_CLIENT = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
data, mgmt, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = dist.TCPStore(data, port, None, is_master=False, timeout=timedelta(seconds=10))
store.set("key", "through data")
print("DATA", store.get("key").decode(), flush=True)
try:
    socket.create_connection((mgmt, port), timeout=5).close()
    print("MGMT connected", flush=True)
except ConnectionRefusedError:
    print("MGMT refused", flush=True)
"""


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Children started here get SIGINT's default action even where the test's own
    process ignores it (a background job of a script): as from a terminal."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _client(port: int) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, None, is_master=False, timeout=timedelta(seconds=10)
    )


def _listening_addresses(port: int) -> list[tuple[str, str]]:
    """(table, hex local address) of every socket listening on ``port`` here."""
    found = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{table}") as rows:
            for row in list(rows)[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    found.append((table, local.split(":")[0]))
    return found


def _start_job(started: list[subprocess.Popen[str]], **extra: str) -> list[subprocess.Popen[str]]:
    """Two agang ranks that will meet on a store hosted elsewhere, once told its port."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(**rank_env(rank, 0, agent_store=True), **extra),  # the port: on stdin
        )
        for rank in range(2)
    ]
    started.extend(ranks)
    return ranks


def _run_job(ranks: list[subprocess.Popen[str]], port: int) -> list[Any]:
    """Each rank's result (or its output, where it has none) once it met the others."""
    results = []
    for rank in ranks:
        assert rank.stdin is not None
        rank.stdin.write(f"{port}\n")
        rank.stdin.flush()
    for rank in ranks:
        output, _ = rank.communicate(timeout=90)
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(lines[0][len("RESULT ") :]) if lines else output)
    return results


@pytest.fixture(scope="module")
def scenario() -> Iterator[dict[str, Any]]:
    started: list[subprocess.Popen[str]] = []
    facts: dict[str, Any] = {}
    try:
        with _sigint_not_ignored():
            store = Store(started)
            second = Store(started)  # for SIGINT
        job, second_run = _start_job(started), _start_job(started, TORCHELASTIC_RESTART_COUNT="1")
        facts["first_line"] = first = store.out.next(60)
        match = LISTENING.fullmatch(first)
        assert match is not None, first
        port = int(match.group(2))
        facts["listening"] = _listening_addresses(port)
        client = _client(port)
        client.set("greeting", "hello")
        facts["got"] = client.get("greeting")
        facts["joined"] = store.err.wait_for("joined: ", 5)
        del client
        facts["left"] = store.err.wait_for("left: ", 5)
        facts["job"] = _run_job(job, port)
        facts["alive_after_job"] = store.process.poll() is None
        client = _client(port)
        facts["got_after_job"] = client.get("greeting")
        del client
        # The store keeps a run's keys: a second run meets under a new restart count.
        facts["second_run"] = _run_job(second_run, port)
        second.out.next(60)  # its handlers are set once it says where it listens
        store.signal(signal.SIGTERM)
        second.signal(signal.SIGINT)
        facts["SIGTERM"], facts["SIGINT"] = store.stopped(), second.stopped()
        yield facts
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def test_port_0_prints_the_real_port_first_and_serves_tcpstore_clients(
    scenario: dict[str, Any],
) -> None:
    match = LISTENING.fullmatch(scenario["first_line"])
    assert match is not None
    assert match.group(1) == "127.0.0.1"
    assert 0 < int(match.group(2)) < 65536
    assert scenario["got"] == b"hello"


def test_the_store_listens_on_the_given_address_only(scenario: dict[str, Any]) -> None:
    loopback = format(struct.unpack("=I", socket.inet_aton("127.0.0.1"))[0], "08X")
    assert scenario["listening"] == [("tcp", loopback)]  # not 0.0.0.0, nor [::]


def test_joins_and_leaves_are_logged(scenario: dict[str, Any]) -> None:
    joined = re.search(r"joined: (127\.0\.0\.1:\d+) \(1 connected\)", scenario["joined"])
    left = re.search(r"left: (127\.0\.0\.1:\d+) \(0 connected\)", scenario["left"])
    assert joined is not None, scenario["joined"]
    assert left is not None, scenario["left"]
    assert joined.group(1) == left.group(1)


def test_two_ranks_meet_on_the_store_and_it_outlives_them(scenario: dict[str, Any]) -> None:
    assert scenario["job"] == [{"rank": 0, "sum": [3.0] * 4}, {"rank": 1, "sum": [3.0] * 4}]
    assert scenario["alive_after_job"]
    assert scenario["got_after_job"] == b"hello"


def test_a_second_run_with_a_new_restart_count_meets_on_the_same_store(
    scenario: dict[str, Any],
) -> None:
    assert scenario["second_run"] == [
        {"rank": 0, "sum": [3.0] * 4},
        {"rank": 1, "sum": [3.0] * 4},
    ]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_store_with_status_0_promptly(
    scenario: dict[str, Any], signame: str
) -> None:
    stopped = scenario[signame]
    assert stopped["status"] == 0
    assert stopped["took"] < STOP_BOUND
    assert stopped["last"] == "agang store stopped"
    assert any(f"{signame} received; stopping." in line for line in stopped["log"])


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--host", "203.0.113.7"], "--host"),  # TEST-NET-3: no address of this machine
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--port", "taken"], "--port"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_option(
    arguments: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        arguments = [str(taken.getsockname()[1]) if a == "taken" else a for a in arguments]
        with pytest.raises(SystemExit) as exited:
            main(["store", *arguments])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert named in error
    assert "agang store listening" not in error


def test_every_interface_is_served_when_asked_for_with_a_warning() -> None:
    # Without the flag, a wildcard --host is refused (tests/unit/cli/test_store.py).
    started: list[subprocess.Popen[str]] = []
    try:
        store = Store(started, "--host", "0.0.0.0", "--port", "0", "--allow-all-interfaces")
        first = store.out.next(60)
        match = LISTENING.fullmatch(first)
        assert match is not None, (first, store.err.rest(5))
        assert match.group(1) == "0.0.0.0"
        port = int(match.group(2))
        warning = store.err.wait_for("every interface", 5)
        assert "--allow-all-interfaces" in warning
        assert "no authentication" in warning
        assert f"port {port} can join or disrupt the job" in warning
        assert _listening_addresses(port) == [("tcp", "00000000")]
        # Its joins are logged, though it is reached on an address it was not given.
        client = _client(port)
        client.set("greeting", "hello")
        assert client.get("greeting") == b"hello"
        assert re.search(
            r"joined: 127\.0\.0\.1:\d+ \(1 connected\)", store.err.wait_for("joined: ", 5)
        )
        del client
        store.signal(signal.SIGTERM)
        assert store.stopped()["status"] == 0
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


@pytest.fixture
def netns() -> None:
    """Skips where namespaces cannot be made; clears what dead test runs left behind."""
    require_netns()
    clean_leftovers()


@pytest.mark.usefixtures("netns")
def test_the_store_is_reachable_on_its_address_and_refused_on_another_of_the_node() -> None:
    with Cluster(num_nodes=2, networks=("data", "mgmt")) as cluster:
        data, mgmt = cluster.nodes[0].address("data"), cluster.nodes[0].address("mgmt")
        argv = [sys.executable, "-m", "agang", "store", "--host", data]
        store = cluster.popen(0, argv, env={"PYTHONPATH": str(ROOT)})
        output = Lines(store.stdout)
        try:
            match = LISTENING.search(output.wait_for("agang store listening on", 60))
            assert match is not None
            assert match.group(1) == data
            port = match.group(2)
            client = cluster.run(1, [sys.executable, "-c", _CLIENT, data, mgmt, port], timeout=60)
            assert client.returncode == 0, client.stdout
            assert "DATA through data" in client.stdout
            assert "MGMT refused" in client.stdout
        finally:
            if store.poll() is None:
                store.kill()
            store.wait(timeout=30)
