"""Many machines on one: network namespaces as nodes, joined by private switched networks.

``Cluster`` builds N "nodes" (network namespaces) and, per network, a "switch" (one
namespace holding a Linux bridge per network) with one veth cable per node. Each node
gets one address per network, ``lo`` up, and its own ``/etc/hosts`` (``ip netns exec``
bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``): a copy of this
machine's, so the node's hostname still resolves to loopback as it does on many real
machines (the trap multi-host set-ups fall into), plus a name per node and network
(``agnode0`` for the data address of node 0, ``agnode0-mgmt`` for its mgmt address).

Rules:
1. Only namespaces this module creates are touched: the host's own interfaces and routes
   never are (every veth is created directly inside namespaces).
2. Names are ``agang-<pid>-<random>-<role>``, so concurrent clusters never clash and a
   leftover whose creating pid is dead can be told apart (``clean_leftovers``).
3. Teardown always runs on leaving the ``with`` block (failure, timeout, Ctrl-C): the
   processes it started are ended by their process group, then any process still inside
   one of its namespaces (only ours can be there: e.g. torchrun's workers, which get
   sessions of their own) by pid, then the namespaces and hosts files are deleted.
4. Nodes' interfaces are named ``<network><node>`` (``data0``, ``data1``): different on
   each node, so nothing can work by assuming one name everywhere.

Example:
    >>> with Cluster(num_nodes=2, networks=("data", "mgmt")) as cluster:
    ...     cluster.run(0, ["python", "-c", "print(1)"])
    ...     cluster.nodes[1].address("data")  # '10.201.0.2'
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

PREFIX = "agang-"
# Private subnets for the test networks: node i is .(i + 1). Each cluster has switches of
# its own, so clusters never see each other's addresses.
SUBNETS = {"data": "10.201.0", "mgmt": "10.202.0", "extra": "10.203.0"}
NETNS_HOSTS_DIR = "/etc/netns"
_NAME = re.compile(r"^agang-(\d+)-[0-9a-f]+-")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _netns_list() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(name: str) -> None:
    _ip("netns", "delete", name, check=False)
    shutil.rmtree(os.path.join(NETNS_HOSTS_DIR, name), ignore_errors=True)
    with contextlib.suppress(OSError):  # only if no other namespace has files there
        os.rmdir(NETNS_HOSTS_DIR)


def clean_leftovers() -> list[str]:
    """Deletes ``agang-*`` namespaces (and their hosts files) whose creating pid is dead.

    Processes still inside one were started by that dead run (nothing else enters these
    namespaces): they are killed by pid first.

    Returns:
        The names deleted.
    """
    deleted = []
    for name in _netns_list():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_pids_in(name)
            _delete_netns(name)
            deleted.append(name)
    return deleted


def _pids_in(namespace: str) -> list[int]:
    listed = _ip("netns", "pids", namespace, check=False).stdout.split()
    return [int(pid) for pid in listed if pid.isdigit()]


def _kill_pids_in(namespace: str) -> None:
    for pid in _pids_in(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


_available: tuple[bool, str] | None = None


def netns_available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and why not: (True, "") or (False, reason)."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, but this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root, but the tests run as a user"
    if shutil.which("ip") is None:
        return False, "network namespaces need iproute2's `ip`, which is not installed"
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return False, f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        bridge = _ip("-n", name, "link", "add", "probe-br", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return False, f"a Linux bridge cannot be made: {bridge.stderr.strip()}"
    finally:
        _delete_netns(name)
    return True, ""


def require_netns() -> None:
    """Skips the calling test, with the reason, where namespaces cannot be made."""
    import pytest

    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)


@dataclass
class Node:
    """One machine of the cluster: a namespace with an address per network."""

    index: int
    namespace: str
    hostname: str
    addresses: dict[str, str] = field(default_factory=dict)

    def address(self, network: str = "data") -> str:
        return self.addresses[network]

    def ifname(self, network: str = "data") -> str:
        return f"{network}{self.index}"


class Cluster:
    """N nodes joined by one switched private network per name in ``networks``.

    Args:
        num_nodes: How many nodes (2 to 200).
        networks: Names of the networks, each from ``SUBNETS``; every node is on all.
        hostname_prefix: Node i's data address is named ``<prefix><i>`` in every node's
            hosts file (``<prefix><i>-<network>`` for the other networks).
        own_name_on_loopback: Each node's hosts file maps the node's own name to
            127.0.1.1 instead of its data address, as Debian's and Ubuntu's installers
            write it: the node's name then means loopback on that node only.
    """

    def __init__(
        self,
        num_nodes: int = 2,
        networks: Sequence[str] = ("data",),
        *,
        hostname_prefix: str = "agnode",
        own_name_on_loopback: bool = False,
    ) -> None:
        if not 2 <= num_nodes <= 200:
            raise ValueError(f"`num_nodes` must be in [2, 200], but is {num_nodes} instead.")
        unknown = [network for network in networks if network not in SUBNETS]
        if unknown or not networks:
            raise ValueError(
                f"`networks` must be a non-empty subset of {sorted(SUBNETS)}, but is "
                f"{list(networks)} instead."
            )
        self.networks = tuple(networks)
        self.own_name_on_loopback = own_name_on_loopback
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.nodes = [
            Node(index=i, namespace=f"{self.tag}-n{i}", hostname=f"{hostname_prefix}{i}")
            for i in range(num_nodes)
        ]
        for node in self.nodes:
            for network in self.networks:
                node.addresses[network] = f"{SUBNETS[network]}.{node.index + 1}"
        self._processes: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []

    # -- set-up and teardown ------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_netns(self.switch)
        for network in self.networks:
            _ip("-n", self.switch, "link", "add", f"br-{network}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br-{network}", "up")
        for node in self.nodes:
            self._add_netns(node.namespace)
            for network in self.networks:
                port = f"{network}-n{node.index}"
                _ip("link", "add", node.ifname(network), "netns", node.namespace, "type",
                    "veth", "peer", "name", port, "netns", self.switch)  # fmt: skip
                _ip("-n", self.switch, "link", "set", port, "master", f"br-{network}")
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", node.namespace, "addr", "add", f"{node.address(network)}/24",
                    "dev", node.ifname(network))  # fmt: skip
                _ip("-n", node.namespace, "link", "set", node.ifname(network), "up")
            self._write_hosts(node)

    def _write_hosts(self, node: Node) -> None:
        with open("/etc/hosts") as host_file:
            lines = [host_file.read().rstrip("\n"), "# agang test cluster"]
        for other in self.nodes:
            for network in self.networks:
                name = other.hostname if network == "data" else f"{other.hostname}-{network}"
                address = other.address(network)
                if other is node and network == "data" and self.own_name_on_loopback:
                    address = "127.0.1.1"
                lines.append(f"{address} {name}")
        folder = os.path.join(NETNS_HOSTS_DIR, node.namespace)
        for _ in range(5):  # another cluster's teardown may remove the empty parent meanwhile
            with contextlib.suppress(FileNotFoundError):
                os.makedirs(folder, exist_ok=True)
                break
        with open(os.path.join(folder, "hosts"), "w") as hosts:
            hosts.write("\n".join(lines) + "\n")

    def close(self) -> None:
        """Ends every process started here and deletes the namespaces; idempotent."""
        for process in self._processes:
            _end_group(process)
        for name in self._made:
            _kill_pids_in(name)
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self._processes.clear()
        for name in reversed(self._made):
            _delete_netns(name)
        self._made.clear()

    # -- processes ------------------------------------------------------------------------

    def _argv(self, index: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[index].namespace, *argv]

    def via(self, index: int) -> list[str]:
        """The command that runs what follows it on node ``index`` (it execs it: the
        same pid), for a process this cluster does not start (ended by its starter; the
        teardown ends whatever is left in the namespace)."""
        return self._argv(index, [])

    @staticmethod
    def _env(env: Mapping[str, str | None] | None) -> dict[str, str]:
        merged = dict(os.environ)
        for name, value in (env or {}).items():
            if value is None:
                merged.pop(name, None)
            else:
                merged[name] = value
        return merged

    def popen(
        self,
        index: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` on node ``index`` in a session of its own; ended at teardown.

        ``env`` is added to this process's environment (a None value removes the name).
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        kwargs.setdefault("text", True)
        process = subprocess.Popen(
            self._argv(index, argv), env=self._env(env), start_new_session=True, **kwargs
        )
        self._processes.append(process)
        return process

    def run(
        self,
        index: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on node ``index`` to its end (at most ``timeout`` seconds)."""
        process = self.popen(index, argv, env=env)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(process)
            output, _ = process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, output, "")

    def free_port(self, index: int, network: str = "data") -> int:
        """A port free on node ``index``'s address a moment ago (the kernel's pick)."""
        probe = (
            "import socket; s = socket.socket(); "
            f"s.bind(({self.nodes[index].address(network)!r}, 0)); print(s.getsockname()[1])"
        )
        done = subprocess.run(
            self._argv(index, [sys.executable, "-c", probe]),
            capture_output=True, text=True, check=True, timeout=30,
        )  # fmt: skip
        return int(done.stdout.strip())

    # -- links ----------------------------------------------------------------------------

    def link_down(self, index: int, network: str = "data") -> None:
        """Cuts node ``index``'s cable to ``network`` (its interface goes down)."""
        node = self.nodes[index]
        _ip("-n", node.namespace, "link", "set", node.ifname(network), "down")

    def link_up(self, index: int, network: str = "data") -> None:
        node = self.nodes[index]
        _ip("-n", node.namespace, "link", "set", node.ifname(network), "up")

    def limit_rate(self, index: int, rate: str, network: str = "data") -> str:
        """Limits what node ``index`` receives on ``network`` to ``rate`` (tc's units:
        "40mbit"), with a token bucket on the switch's port; "" when done, else why not
        (tc missing, or the kernel lacks sch_tbf)."""
        if shutil.which("tc") is None:
            return "iproute2's `tc` is not installed"
        port = f"{network}-n{index}"
        done = subprocess.run(
            ["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", "tbf",
             "rate", rate, "burst", "32kbit", "latency", "500ms"],
            capture_output=True, text=True, check=False, timeout=30,
        )  # fmt: skip
        return "" if done.returncode == 0 else f"tc's tbf failed: {done.stderr.strip()}"

    def counters(self, index: int, network: str = "data") -> dict[str, int]:
        """Bytes and packets node ``index`` sent and received on ``network`` so far."""
        node = self.nodes[index]
        shown = _ip("-n", node.namespace, "-s", "-j", "link", "show", "dev", node.ifname(network))
        stats = json.loads(shown.stdout)[0]["stats64"]
        return {
            "rx_bytes": int(stats["rx"]["bytes"]),
            "tx_bytes": int(stats["tx"]["bytes"]),
            "rx_packets": int(stats["rx"]["packets"]),
            "tx_packets": int(stats["tx"]["packets"]),
        }


def _end_group(process: subprocess.Popen[Any]) -> None:
    """SIGTERM to the process's group (its own session), SIGKILL after 3 s."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is not None:
            return
