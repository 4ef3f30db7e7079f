"""Which network interface the ranks' own connections (Gloo's, NCCL's sockets) use.

Without a setting, Gloo binds to the address this host's name resolves to and tells its
peers to connect there. On many hosts (Debian and Ubuntu put the hostname on 127.0.1.1;
containers often on 127.0.0.1) that is a loopback address, and a job across machines
then fails in init with "connection refused" at 127.0.x.1. NCCL's bootstrap guesses an
interface of its own, which may be a different network than the one the job meant.

Rules:
1. The user's choice wins: a ``GLOO_SOCKET_IFNAME`` or ``NCCL_SOCKET_IFNAME`` already set
   is kept, each on its own; ``AGANG_SOCKET_IFNAME`` names one interface for both.
2. Otherwise the interface that reaches ``MASTER_ADDR``: the one holding the source
   address the kernel's route to it leaves from (a UDP socket connected to it, which
   sends nothing). On the host that holds ``MASTER_ADDR`` that is the interface with
   that very address, not ``lo``.
3. agang sets ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` on NCCL) to it before the
   process group exists, and logs it; ``agang doctor`` reports the choice.
4. When it cannot tell (the name does not resolve, no route, no interface holds the
   source address), nothing is set and a warning says so.
5. A job that spans hosts cannot meet at a loopback ``MASTER_ADDR``: init fails at once,
   naming what it resolved to, instead of waiting for its deadline. (torchrun passes on
   rank 0's host name; where that name resolves to loopback, ``--local-addr`` fixes it.)
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

from agang._errors import GangInitError

log = logging.getLogger("agang.setup")

#: One interface for both transports, named by the user.
IFNAME_ENV = "AGANG_SOCKET_IFNAME"

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's addresses (IPv4 by ioctl, IPv6 from /proc/net/if_inet6)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                )
            except OSError:
                continue  # no IPv4 address
            found.setdefault(name, []).append(socket.inet_ntoa(answer[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) == 6:
                address = str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
                found.setdefault(fields[5], []).append(address)
    return found


def source_address(host: str) -> str | None:
    """The address this host's route to ``host`` leaves from; None if it has none."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, where in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(where)  # UDP: picks the route, sends nothing
                return str(probe.getsockname()[0]).split("%")[0]
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class Link:
    """The interface this rank's connections leave from, as its peers learn at check-in."""

    ifname: str | None
    address: str | None
    network: str | None  # its IPv4 network, e.g. "10.201.0.0/24"; None where unknown

    def to_text(self) -> str:
        return " ".join(part or "-" for part in (self.ifname, self.address, self.network))

    @classmethod
    def from_text(cls, text: str) -> Link:
        parts = [None if part == "-" else part for part in text.split()] + [None] * 3
        return cls(parts[0], parts[1], parts[2])


def own_link(master_addr: str, environ: Mapping[str, str]) -> Link:
    """The interface the transports were told to use (rule 3), or the one reaching
    ``master_addr``, with its address and network."""
    table = interface_addresses()
    named = (environ.get("GLOO_SOCKET_IFNAME") or environ.get("NCCL_SOCKET_IFNAME") or "").strip()
    ifname = named.split(",")[0] or None
    address = None
    if ifname is not None:
        address = next((a for a in table.get(ifname, []) if "." in a), None)
    else:
        address = source_address(master_addr)
        ifname = next((name for name, found in table.items() if address in found), None)
    network = None
    if ifname is not None and address is not None and "." in address:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, struct.pack("256s", ifname.encode()))
            mask = socket.inet_ntoa(answer[20:24])
            network = str(ipaddress.IPv4Network(f"{address}/{mask}", strict=False))
    return Link(ifname, address, network)


def disagreement(links: Mapping[int, Link]) -> str | None:
    """A warning when the ranks' connections leave from different networks, else None
    (names differ between hosts harmlessly; networks should not)."""
    networks: dict[str, list[int]] = {}
    for rank, link in sorted(links.items()):
        if link.network is not None:
            networks.setdefault(link.network, []).append(rank)
    if len(networks) < 2:
        return None
    sides = "; ".join(f"ranks {ranks} on {network}" for network, ranks in networks.items())
    return (
        f"agang: the ranks of this job use interfaces on different networks ({sides}): "
        f"their connections may fail or take a slower network. Set {IFNAME_ENV} (or "
        f"GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) to the same network's interface on "
        f"every host."
    )


@dataclass(frozen=True)
class Choice:
    """The interface for the ranks' connections, and how it was chosen."""

    ifname: str | None
    why: str
    candidates: tuple[str, ...] = ()  # interfaces with a non-loopback address


def choose_interface(
    master_addr: str,
    env: Mapping[str, str],
    *,
    addresses: Callable[[], dict[str, list[str]]] = interface_addresses,
    route: Callable[[str], str | None] = source_address,
) -> Choice:
    """The interface that reaches ``master_addr`` (rules 1, 2, 4)."""
    table = addresses()
    candidates = tuple(
        name
        for name, found in table.items()
        if any(not ipaddress.ip_address(a).is_loopback for a in found if _is_ip(a))
    )
    named = env.get(IFNAME_ENV, "").strip()
    if named:
        return Choice(named, f"named by {IFNAME_ENV}", candidates)
    source = route(master_addr)
    if source is None:
        return Choice(None, f"no route from this host to MASTER_ADDR {master_addr!r}", candidates)
    for name, found in table.items():
        if source in found:
            return Choice(
                name, f"it holds {source}, the address that reaches {master_addr}", candidates
            )
    return Choice(None, f"no interface holds {source}, the route's source address", candidates)


def apply_interface(
    master_addr: str, environ: MutableMapping[str, str], *, nccl: bool
) -> dict[str, str]:
    """Sets the socket interface variables the user left unset (rule 3); returns them."""
    wanted = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if nccl else [])
    unset = [name for name in wanted if not environ.get(name)]
    if not unset:
        return {}
    choice = choose_interface(master_addr, environ)
    if choice.ifname is None:
        log.warning(
            "agang: cannot tell which network interface reaches MASTER_ADDR (%s); %s is "
            "left unset. Set %s if ranks on other hosts cannot connect.",
            choice.why,
            " and ".join(unset),
            IFNAME_ENV,
        )
        return {}
    made = {}
    for name in unset:
        environ[name] = choice.ifname
        made[name] = choice.ifname
        log.info("agang: set %s=%s (%s).", name, choice.ifname, choice.why)
    return made


def check_master_reachable(master_addr: str, world_size: int, local_size: int | None) -> None:
    """Rule 5: raises ``GangInitError`` for a loopback ``MASTER_ADDR`` in a multi-host job."""
    if local_size is None or world_size <= local_size:
        return
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return  # the store connection will say so, with its retries
    addresses = sorted({str(info[4][0]).split("%")[0] for info in infos})
    if addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise GangInitError(
            f"`MASTER_ADDR` must reach rank 0's host from every host of a job of "
            f"{world_size} ranks with {local_size} on this one, but {master_addr!r} resolves "
            f"to the loopback address {', '.join(addresses)} here. Set MASTER_ADDR to rank "
            f"0's address on the network that joins the hosts; under torchrun, pass "
            f"--local-addr with each host's address (torchrun hands on rank 0's host name, "
            f"which this host's /etc/hosts maps to loopback)."
        )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
