"""``agang doctor``'s network checks: can the ranks meet at MASTER_ADDR:MASTER_PORT?

The store host (rank 0, unless the launcher's agent hosts the store) must be able to bind
the port on the address; every other process must be able to connect to it. Rules:

1. The probe bounds every call in time: a resolver or a firewall that never answers costs
   at most the probe's timeout.
2. A MASTER_ADDR that resolves only to loopback in a job across nodes is the problem named,
   and the port and interface checks are skipped: about loopback, they would mislead.
3. Findings about reaching the store name this host's interface toward it (the one on
   MASTER_ADDR's network, else the route's), and an interface that is down is a problem
   of its own, with what to bring up or set (``agang._cli.doctor.links``).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol, final

from agang._cli.doctor.findings import Finding, Status
from agang._cli.doctor.links import LinkState, link_toward, probe_links
from agang._setup.env import WorldInfo
from agang._setup.interface import IFNAME_ENV, Choice, choose_interface


class NetworkProbe(Protocol):
    """The network calls the doctor makes; each is bounded by the probe's own timeout."""

    def resolve(self, host: str) -> Sequence[str]:
        """The IP addresses of ``host``, in resolver order; raises OSError on failure."""
        ...

    def bind(self, address: str, port: int) -> None:
        """Binds ``port`` on the IP ``address`` and releases it; raises OSError if it can't."""
        ...

    def connect(self, address: str, port: int) -> None:
        """Opens and closes a TCP connection to ``address:port``; raises OSError if it can't."""
        ...

    def interface(self, host: str, env: Mapping[str, str]) -> Choice:
        """The interface agang's init would give the ranks' connections to reach ``host``."""
        ...

    def links(self) -> Sequence[LinkState]:
        """This host's interfaces (not loopback): up or down, and their networks."""
        ...


@final
class SocketProbe:
    """The real ``NetworkProbe``, each call bounded by ``timeout`` seconds.

    Args:
        timeout: Seconds each resolve or connect may take.
    """

    def __init__(self, timeout: float = 1.0) -> None:
        self.timeout = timeout

    def interface(self, host: str, env: Mapping[str, str]) -> Choice:
        return choose_interface(host, env)

    def links(self) -> Sequence[LinkState]:
        return probe_links()

    def resolve(self, host: str) -> Sequence[str]:
        try:  # an IP address is its own answer, as written: no resolver to wait for
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            return [host]
        # getaddrinfo has no timeout of its own: it runs on a daemon thread that is left
        # behind (and ends with the process) if the resolver does not answer in time.
        result: list[Sequence[str] | OSError] = []

        def lookup() -> None:
            try:
                infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                result.append(list(dict.fromkeys(str(info[4][0]) for info in infos)))
            except OSError as exc:
                result.append(exc)

        thread = threading.Thread(target=lookup, name="agang doctor: resolve", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if not result:
            raise TimeoutError(f"no answer from the resolver in {self.timeout:g} s")
        if isinstance(result[0], OSError):
            raise result[0]
        return result[0]

    def bind(self, address: str, port: int) -> None:
        with socket.socket(_family(address), socket.SOCK_STREAM) as sock:
            # As c10d's store does, so that a port in TIME_WAIT reads as free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))

    def connect(self, address: str, port: int) -> None:
        with socket.socket(_family(address), socket.SOCK_STREAM) as sock:
            sock.settimeout(self.timeout)
            sock.connect((address, port))


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def network_findings(
    world: WorldInfo,
    network: NetworkProbe,
    *,
    address_origin: str = "",
    env: Mapping[str, str] | None = None,
) -> list[Finding]:
    """Whether MASTER_ADDR resolves, and the store port can be bound or reached.

    Args:
        world: This process's world (of more than one rank).
        network: Resolves, binds and connects, each within a bounded time.
        address_origin: Where agang took the address from, when not from MASTER_ADDR
            itself (e.g. "the first host of SLURM_JOB_NODELIST").
        env: The environment, for the interface variables the user may have set.

    Returns:
        The findings: the address, then the port and the interface (both skipped when the
        address does not resolve, or resolves only to loopback in a job across nodes).
    """
    host = world.master_addr
    origin = f" ({address_origin})" if address_origin else ""
    local_size = world.local_world_size
    try:
        addresses = list(network.resolve(host))
        if not addresses:
            raise OSError(f"no address for {host!r}")
    except OSError as exc:
        return [
            Finding(
                "MASTER_ADDR",
                Status.PROBLEM,
                f"`MASTER_ADDR` {host!r}{origin} does not resolve: "
                f"{str(exc) or type(exc).__name__}.",
                causes=(
                    "a typo in the name",
                    "the name is known on rank 0's node but not on this one (DNS, /etc/hosts)",
                    "the resolver is slow or unreachable",
                ),
                fix="Set MASTER_ADDR to rank 0's IP address, or to a name that every node "
                "resolves (check with `getent hosts NAME` on each node).",
            )
        ]
    findings = [
        Finding("MASTER_ADDR", Status.OK, f"{host!r}{origin} resolves to {', '.join(addresses)}.")
    ]
    if local_size is not None and world.world_size > local_size and _all_loopback(addresses):
        findings.append(_loopback_finding(world, local_size, addresses, origin))
        return findings  # rule 2
    # The kernel's route, whatever the user named for the transports: the store's path.
    route = network.interface(host, {})
    toward = link_toward(network.links(), addresses, route.ifname)
    findings.append(_port_finding(world, addresses, network, toward))
    findings.append(_interface_finding(host, addresses, network, env or {}, toward))
    return findings


def _loopback_finding(
    world: WorldInfo, local_size: int, addresses: Sequence[str], origin: str
) -> Finding:
    host = world.master_addr
    where = (
        f"for a world of {world.world_size} with {local_size} rank{'s' * (local_size != 1)} "
        f"on this node"
    )
    if host in addresses:  # an address, not a name
        return Finding(
            "MASTER_ADDR",
            Status.PROBLEM,
            f"`MASTER_ADDR` must be reachable from other nodes {where}, but is the loopback "
            f"address {host!r} instead.",
            fix="Set MASTER_ADDR to rank 0's host name or IP address on the network that "
            "joins the nodes.",
        )
    return Finding(
        "MASTER_ADDR",
        Status.PROBLEM,
        f"`MASTER_ADDR` must be reachable from other nodes {where}, but {host!r}{origin} "
        f"resolves to the loopback address {', '.join(addresses)} on this node instead.",
        causes=(
            "this node's /etc/hosts maps the name to loopback, as Debian and Ubuntu do with "
            "a host's own name (127.0.1.1)",
            "torchrun handed on rank 0's host name, which this node's /etc/hosts maps to loopback",
        ),
        fix="Set MASTER_ADDR to rank 0's IP address on the network that joins the nodes, or "
        "map the name to that address in every node's /etc/hosts; under torchrun, pass "
        "--local-addr with each node's address.",
    )


def _interface_finding(
    host: str,
    addresses: Sequence[str],
    network: NetworkProbe,
    env: Mapping[str, str],
    toward: LinkState | None,
) -> Finding:
    """Which interface the ranks' connections use (``agang._setup.interface``)."""
    given = [
        f"{name}={env[name]}"
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if env.get(name)
    ]
    if given:
        return Finding("interface", Status.OK, f"Set by you: {', '.join(given)}.")
    choice = network.interface(host, env)
    if toward is not None and toward.down and choice.ifname in (None, toward.name):
        return _down_finding(host, addresses, toward, chosen=choice.ifname is not None)
    if choice.ifname is None:
        return Finding(
            "interface",
            Status.WARN,
            f"agang cannot tell which interface reaches {host!r} ({choice.why}); Gloo will "
            f"bind to the address this host's name resolves to.",
            causes=("that address may be a loopback one, which other nodes cannot reach",),
            fix=f"Set {IFNAME_ENV} (or GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME) to the "
            f"interface of the network that joins the nodes.",
        )
    # Several networks matter only off loopback: a job on one host needs no other.
    on_loopback = choice.ifname not in choice.candidates
    others = [] if on_loopback else [n for n in choice.candidates if n != choice.ifname]
    seen = f"agang will use {choice.ifname} for the ranks' connections: {choice.why}."
    if others:
        return Finding(
            "interface",
            Status.WARN,
            f"{seen} This host has other networks too: {', '.join(others)}.",
            causes=("the job may be meant to run on one of the others (InfiniBand, say)",),
            fix=f"If {choice.ifname} is not the network that joins the nodes, set "
            f"{IFNAME_ENV} to the right interface, the same choice on every node.",
        )
    return Finding("interface", Status.OK, seen)


def _down_finding(host: str, addresses: Sequence[str], link: LinkState, *, chosen: bool) -> Finding:
    name = link.name
    networks = link.network_holding(addresses[0]) or ", ".join(link.networks)
    what = f"{name}, this host's interface toward {host!r}" + (
        f" ({networks})," if networks else ","
    )
    then = (
        "agang would use it for the ranks' connections, but nothing leaves through it."
        if chosen
        else "there is no route to MASTER_ADDR, so agang cannot choose an interface for the "
        "ranks' connections."
    )
    causes = (
        (
            f"it was taken down (`ip link set {name} down`), or never brought up",
            "its cable or switch port failed, and the system took it down",
        )
        if not link.up
        else ("its cable is unplugged or broken", "the switch port at the far end is down")
    )
    return Finding(
        "interface",
        Status.PROBLEM,
        f"{what} {link.down}: {then}",
        causes=causes,
        fix=f"Bring {name} up and check its link, route and firewall (`ip link show {name}`, "
        f"`ip route get {addresses[0]}`); if another network joins the nodes, set "
        f"{IFNAME_ENV} to its interface and MASTER_ADDR to rank 0's address on it.",
    )


def _all_loopback(addresses: Sequence[str]) -> bool:
    try:
        return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)
    except ValueError:
        return False


def _port_finding(
    world: WorldInfo,
    addresses: Sequence[str],
    network: NetworkProbe,
    toward: LinkState | None,
) -> Finding:
    port = world.master_port
    if port == 0:
        return Finding(
            "MASTER_PORT",
            Status.PROBLEM,
            f"`MASTER_PORT` must be a fixed port for a world of {world.world_size}, but is 0 "
            f"instead: the other ranks cannot learn a port that rank 0 picks.",
            fix="Set MASTER_PORT to a free port (1024-65535), the same on every rank.",
        )
    if world.rank == 0 and not world.launcher_hosts_store:
        return _bind_finding(world, addresses[0], network)
    return _connect_finding(world, addresses, network, toward)


def _bind_finding(world: WorldInfo, address: str, network: NetworkProbe) -> Finding:
    port = world.master_port
    try:
        network.bind(address, port)
    except OSError as exc:
        error = exc
    else:
        return Finding(
            "MASTER_PORT",
            Status.OK,
            f"Port {port} is free on {address}; this rank will host the store there.",
        )
    code = error.errno
    if code == errno.EADDRINUSE and world.port_is_derived:
        return Finding(
            "MASTER_PORT",
            Status.WARN,
            f"Port {port}, derived from SLURM_JOB_ID, is taken on {address} by another "
            f"process; agang may move the store to a free port nearby.",
            causes=("another job on this node derived or chose the same port",),
            fix="Set MASTER_PORT to a free port, the same on every task, to choose it yourself.",
        )
    if code == errno.EADDRINUSE:
        return Finding(
            "MASTER_PORT",
            Status.PROBLEM,
            f"`MASTER_PORT` must be free on {address} for rank 0 to host the store, but "
            f"port {port} is taken by another process instead.",
            causes=(
                "another job on this node was given the same port",
                "an earlier run of this job is still exiting and holds it",
            ),
            fix=f"Pick another port, the same on every rank (torchrun --master-port=N or "
            f"MASTER_PORT=N), or stop the process that holds it (`ss -ltnp 'sport = :{port}'`).",
        )
    if code == errno.EADDRNOTAVAIL:
        return Finding(
            "MASTER_ADDR",
            Status.PROBLEM,
            f"`MASTER_ADDR` must be an address of rank 0's host, but {world.master_addr!r} "
            f"({address}) is not an address of this host, where rank 0 runs.",
            causes=("MASTER_ADDR names another node", "rank 0 was placed on another node"),
            fix="Set MASTER_ADDR to the host where rank 0 runs (under SLURM: the first node "
            "of the allocation).",
        )
    if code == errno.EACCES:
        return Finding(
            "MASTER_PORT",
            Status.PROBLEM,
            f"`MASTER_PORT` must be a port this user may bind, but is {port} instead "
            f"(ports below 1024 need privileges).",
            fix="Pick a port from 1024 to 65535, the same on every rank.",
        )
    return Finding(
        "MASTER_PORT",
        Status.PROBLEM,
        f"Port {port} cannot be bound on {address}: {error}.",
        fix="Pick another port, the same on every rank.",
    )


def _connect_finding(
    world: WorldInfo,
    addresses: Sequence[str],
    network: NetworkProbe,
    toward: LinkState | None,
) -> Finding:
    port = world.master_port
    host = "the launcher's agent" if world.launcher_hosts_store else "rank 0"
    via = f" from {toward.name}" if toward is not None else ""
    tried = f" (tried from {toward.name})" if toward is not None else ""
    errors: list[OSError] = []
    for address in addresses:
        try:
            network.connect(address, port)
        except OSError as exc:
            errors.append(exc)
        else:
            return Finding(
                "MASTER_PORT", Status.OK, f"The store port {address}:{port} is reachable{via}."
            )
    first = errors[0]
    target = f"{addresses[0]}:{port}"
    if toward is not None and toward.down:
        seen = f"Cannot connect to {target}{via}: {first}."
        causes: tuple[str, ...] = (f"{toward.name} {toward.down} (see the interface check)",)
        fix = f"Bring {toward.name} up (see the interface check), then run the doctor again."
    elif isinstance(first, TimeoutError):
        seen = f"No answer from {target} in time{tried}: packets are dropped or lost."
        causes = (
            "a firewall between this node and rank 0's host drops the connection",
            "a link on the way to rank 0's host is down (a cable, a switch port, or rank "
            "0's own interface)",
            "MASTER_ADDR is not reachable from this node (another network)",
            "rank 0's host is down",
        )
        fix = (
            f"Open port {port} on rank 0's host for the job's nodes, and check from this node "
            f"with `nc -vz {addresses[0]} {port}` while {host} runs; if `ping {addresses[0]}` "
            f"gets no answer either, check the link{via} to rank 0's host."
        )
    elif first.errno == errno.ECONNREFUSED:
        seen = f"Connection to {target} refused{tried}: nothing listens there."
        causes = (
            f"{host} has not started yet, or has already exited",
            "MASTER_ADDR or MASTER_PORT differs between ranks",
            "a firewall rejects the connection",
        )
        fix = (
            f"Start {host} (run the doctor while it is up), and make MASTER_ADDR and "
            f"MASTER_PORT the same on every rank."
        )
    else:
        seen = f"Cannot connect to {target}{via}: {first}."
        causes = ("no route from this node to MASTER_ADDR", "a firewall rejects the connection")
        fix = "Set MASTER_ADDR to an address of rank 0's host that this node can reach."
    return Finding("MASTER_PORT", Status.PROBLEM, seen, causes=causes, fix=fix)
