"""This host's network interfaces, as ``agang doctor`` sees them: up or down, on which networks.

The route to MASTER_ADDR names the interface the ranks' connections leave from. When that
interface is down there is no route at all, so the doctor also looks for the interface
whose network holds MASTER_ADDR: the one that was meant, to name it.

Rules:
1. Linux only (ioctl, ``/proc/net/if_inet6``): elsewhere, or where a call fails, the list
   is empty and the doctor says nothing about the state of links.
2. An interface is down when it is administratively down (``IFF_UP`` unset), or up without
   a carrier (``IFF_RUNNING`` unset: its cable, or the port at the far end, is down).
3. Loopback interfaces are left out: they join no nodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_SIOCGIFFLAGS = 0x8913
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFF_RUNNING = 0x40


@dataclass(frozen=True)
class LinkState:
    """One interface of this host.

    Attributes:
        name: The interface's name, e.g. ``"eth0"``.
        up: Administratively up (``ip link set NAME up``).
        carrier: Operationally up: a carrier is there (always False when not ``up``).
        networks: Its addresses with their prefix length, e.g. ``("10.0.0.5/24",)``.
    """

    name: str
    up: bool
    carrier: bool
    networks: tuple[str, ...] = ()

    @property
    def down(self) -> str | None:
        """Why the interface carries nothing, as a phrase ("is down"), or None if it is up."""
        if not self.up:
            return "is down"
        if not self.carrier:
            return "is up but has no carrier (its cable, or the port at the far end, is down)"
        return None

    def network_holding(self, address: str) -> str | None:
        """Which of its networks holds ``address`` (as ``"10.0.0.5/24"``), if any."""
        try:
            target = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return None
        for network in self.networks:
            interface = ipaddress.ip_interface(network)
            if interface.version == target.version and target in interface.network:
                return network
        return None


def link_toward(
    links: Iterable[LinkState], addresses: Sequence[str], route_ifname: str | None
) -> LinkState | None:
    """The interface a connection to ``addresses`` leaves from: the one whose network holds
    one of them (directly attached, even when down), else the route's, else None."""
    links = list(links)
    for address in addresses:
        for link in links:
            if link.network_holding(address) is not None:
                return link
    return next((link for link in links if link.name == route_ifname), None)


def probe_links() -> list[LinkState]:
    """Every non-loopback interface of this host with its state and networks (rule 1)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    ipv6 = _ipv6_networks()
    links = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                flags = _flags(probe, name)
            except OSError:
                continue
            if flags & _IFF_LOOPBACK:
                continue
            networks = _ipv4_network(probe, name) + ipv6.get(name, ())
            up = bool(flags & _IFF_UP)
            links.append(LinkState(name, up, up and bool(flags & _IFF_RUNNING), networks))
    return links


def _request(name: str) -> bytes:
    return struct.pack("256s", name[:15].encode())


def _flags(probe: socket.socket, name: str) -> int:
    answer = fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, _request(name))
    return int(struct.unpack_from("H", answer, 16)[0])


def _ipv4_network(probe: socket.socket, name: str) -> tuple[str, ...]:
    try:
        address = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, _request(name))
        mask = fcntl.ioctl(probe.fileno(), _SIOCGIFNETMASK, _request(name))
    except OSError:
        return ()  # no IPv4 address
    text = f"{socket.inet_ntoa(address[20:24])}/{socket.inet_ntoa(mask[20:24])}"
    return (ipaddress.IPv4Interface(text).with_prefixlen,)


def _ipv6_networks() -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) == 6:
                address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                network = f"{address}/{int(fields[2], 16)}"
                found[fields[5]] = (*found.get(fields[5], ()), network)
    return found
