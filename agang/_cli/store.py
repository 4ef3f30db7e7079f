"""``agang store``: a rendezvous store in a process of its own, outliving every rank.

It serves c10d's ``TCPStore`` protocol (torch's own server), so ranks join it as they
join torchrun's agent store: ``MASTER_ADDR``/``MASTER_PORT`` name it and
``TORCHELASTIC_USE_AGENT_STORE=1`` tells agang that no rank hosts the store.

Trust: the store has no authentication. Anyone who can reach its port can read and write
every key, and so disturb or impersonate ranks while they meet (claim a rank's check-in,
write a false list of missing ranks, point Gloo at another address). Bind it to the
cluster's private network address only, and firewall the port off from everything else.

Rules:
1. It listens on the one address ``--host`` names (a socket agang binds and hands to
   c10d), not on every interface unless asked. A host that is not an address of this
   machine, and a port in use, are usage errors (exit status 2) naming the option to
   change. So is a host that means every interface (``0.0.0.0``, ``::``, any spelling
   that resolves to one), unless ``--allow-all-interfaces`` asks for it: the store is
   unauthenticated, and on every interface it is open to every network that reaches
   the machine. With the flag it listens there, after a warning on stderr. A host that
   is no host name at all is a usage error too, before any look-up: empty, with spaces
   or characters that do not print, longer than MAX_HOST characters, or with an empty
   label or one of more than 63 characters (``a..b``: IDNA's rules, which Python's
   resolver applies).
2. Its first line on stdout, flushed at once, is ``agang store listening on ADDR:PORT``:
   the address bound (a name is shown resolved; IPv6 in brackets, ``[::1]:PORT``) and
   the real port (``--port 0`` takes a free one). Its last, once the port is closed, is
   ``agang store stopped``.
3. SIGTERM and SIGINT (Ctrl-C) stop it with status 0: the handlers only note the
   signal, and Python's wakeup fd ends the wait at once, whichever thread the kernel
   gave the signal to. A SIGINT ignored when it started (a background job of
   a script) stays ignored.
4. TCPStore reports no connections, so joins and leaves are read from the kernel's table
   (``/proc/net/tcp``, ``tcp6``) every POLL_SECONDS: connections established to the
   listening address, less the store's own client (c10d's master keeps one to itself).
   The table is read only when this process's set of sockets changed (accepts and
   closes change it), so an idle store costs one listing of its own fds per poll.
   At most MAX_LOGGED joins or leaves are logged per poll, then a count. A connection
   that comes and goes within one poll may go unlogged. Where the table cannot be read,
   nothing is logged and the store serves on. A store on every interface counts the
   connections to its port on any local address.
5. Must run on the main thread (signal handlers can only be set there).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
from datetime import timedelta
from types import FrameType
from typing import Any, TextIO

log = logging.getLogger("agang.store")

POLL_SECONDS = 0.2
MAX_LOGGED = 32
_ESTABLISHED = "01"
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
Endpoint = tuple[str, int]


class StoreUsageError(Exception):
    """The command line asks for something this machine cannot do, or should not do
    unasked; names the option."""


#: The option that lets ``--host`` name every interface (rule 1).
ALL_INTERFACES_FLAG = "--allow-all-interfaces"
#: The most characters of ``--host``: a DNS name's (an address is shorter).
MAX_HOST = 253


def _shown(host: str) -> str:
    """``host`` quoted on one line, cut to its first 40 characters (and its length said)
    when long."""
    if len(host) <= 40:
        return repr(host)
    return f"{host[:40]!r}... ({len(host)} characters)"


def check_host(host: str) -> None:
    """Refuses, as a usage error, a ``--host`` that is no host name or address at all
    (rule 1), before anything looks it up."""
    rule = "--host must be an address or host name of this machine"
    if not host:
        raise StoreUsageError(f"{rule}, but is empty instead.")
    if not host.isprintable() or any(c.isspace() for c in host):
        raise StoreUsageError(
            f"{rule} (printable characters, no spaces), but is {_shown(host)} instead."
        )
    if len(host) > MAX_HOST:
        raise StoreUsageError(
            f"{rule} (at most {MAX_HOST} characters), but is {_shown(host)} instead."
        )
    try:
        host.encode("idna")  # how the resolver encodes it
    except UnicodeError as error:
        reason = str(error.__cause__ or error)
        raise StoreUsageError(
            f"{rule} (labels of 1 to 63 characters between dots), but is {_shown(host)} "
            f"instead ({reason})."
        ) from None


def format_endpoint(endpoint: Endpoint) -> str:
    """``ADDR:PORT``, IPv6 addresses in brackets (``[::1]:29500``)."""
    address, port = endpoint
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _normal(address: str) -> str:
    """The address in one spelling: no scope, IPv4-mapped IPv6 as IPv4."""
    parsed = ipaddress.ip_address(address.split("%")[0])
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    return str(parsed)


def _is_every_interface(address: str) -> bool:
    return ipaddress.ip_address(_normal(address)).is_unspecified


def _means_every_interface(host: str) -> bool:
    """Whether ``host`` resolves to the unspecified address (``0.0.0.0``, ``::``): a
    socket bound there listens on every interface. False for a host that does not
    resolve (binding it says so)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return any(_is_every_interface(str(info[4][0])) for info in infos)


def _parse_endpoint(text: str) -> Endpoint:
    """An endpoint as /proc/net/tcp* print it: hex address (32-bit words in host byte
    order), a colon, hex port."""
    address, port = text.split(":")
    words = range(0, len(address), 8)
    raw = b"".join(struct.pack("=I", int(address[i : i + 8], 16)) for i in words)
    return _normal(str(ipaddress.ip_address(raw))), int(port, 16)


class ConnectionWatcher:
    """Who is connected to a listening endpoint, read from the kernel's tables (rule 4).

    Args:
        listening: The store's bound address and port.
    """

    def __init__(self, listening: Endpoint) -> None:
        address, port = listening
        number: object = port  # untyped callers
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
            raise ValueError(f"`listening` must name a port in [1, 65535], but is {listening}.")
        self.listening: Endpoint = (_normal(address), port)
        # Bound to every interface, it is reached on any local address (rule 4).
        self._any_address = _is_every_interface(address)
        self.connected: set[Endpoint] = set()
        self.available = os.path.exists(_TABLES[0])
        self._sockets: frozenset[str] = frozenset()

    def poll(self) -> tuple[list[Endpoint], list[Endpoint]]:
        """The peers that joined and left since the last poll, each sorted."""
        if not self.available:
            return [], []
        sockets = _own_sockets()
        if sockets == self._sockets:
            return [], []
        self._sockets = sockets
        now = self._read(sockets)
        joined, left = sorted(now - self.connected), sorted(self.connected - now)
        self.connected = now
        return joined, left

    def _read(self, sockets: frozenset[str]) -> set[Endpoint]:
        rows: list[tuple[Endpoint, Endpoint, str, str]] = []
        for table in _TABLES:
            try:
                with open(table) as lines:
                    next(lines, None)  # the header
                    for line in lines:
                        fields = line.split()
                        if len(fields) > 9:
                            local, remote = _parse_endpoint(fields[1]), _parse_endpoint(fields[2])
                            rows.append((local, remote, fields[3], fields[9]))
            except OSError:
                continue  # no IPv6 here, say
        # The store's own client: a socket of this process connected to the listener.
        own = {
            local
            for local, remote, _, inode in rows
            if self._is_listener(remote) and inode in sockets
        }
        return {
            remote
            for local, remote, state, _ in rows
            if self._is_listener(local) and state == _ESTABLISHED and remote not in own
        }

    def _is_listener(self, endpoint: Endpoint) -> bool:
        if self._any_address:
            return endpoint[1] == self.listening[1]
        return endpoint == self.listening


def _own_sockets() -> frozenset[str]:
    """The inodes of this process's sockets, as /proc/net/tcp* print them."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    return frozenset(inodes)


def _bind(host: str, port: int) -> socket.socket:
    from agang._setup.rendezvous import listen_on  # imports torch.distributed

    try:
        listener = listen_on(host, port)
    except OSError as error:  # listen_on raises only EADDRINUSE
        raise StoreUsageError(
            f"--port must be a free port on {_shown(host)}, but {port} is in use by another "
            f"process: pick another, or --port 0 for any free one ({error.strerror})."
        ) from None
    if listener is None:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            raise StoreUsageError(
                f"--host must be an address of this machine, but {_shown(host)} does not "
                f"resolve ({error})."
            ) from None
        raise StoreUsageError(
            f"--host must be one address of this machine (the store listens on it only), "
            f"but {_shown(host)} is not (or names loopback and other addresses at once): give "
            f"the address of one of its interfaces, e.g. the cluster's private network "
            f"address, or 127.0.0.1."
        )
    return listener


def _log_changes(verb: str, endpoints: list[Endpoint], connected: int) -> None:
    for endpoint in endpoints[:MAX_LOGGED]:
        log.info("%s: %s (%d connected)", verb, format_endpoint(endpoint), connected)
    if len(endpoints) > MAX_LOGGED:
        log.info("%s: %d more (%d connected)", verb, len(endpoints) - MAX_LOGGED, connected)


def serve_store(
    host: str,
    port: int,
    *,
    quiet: bool = False,
    out: TextIO | None = None,
    allow_all_interfaces: bool = False,
) -> int:
    """Serves a TCPStore on ``host:port`` until SIGTERM or SIGINT (rules 1-3).

    Args:
        host: The address to listen on (one address of this machine).
        port: The port; 0 for a free one.
        quiet: Log no joins and leaves (warnings still go to stderr).
        out: Where the listening and stopped lines go; None for ``sys.stdout``.
        allow_all_interfaces: Let ``host`` mean every interface (``0.0.0.0``, ``::``),
            which is refused otherwise: anyone who reaches the port there can join or
            disrupt the job (rule 1).

    Returns:
        0, once stopped by a signal.

    Raises:
        StoreUsageError: ``host`` is no host name (empty, spaces, too long), is not an
            address here, or means every interface unasked; or ``port`` is taken.
        ValueError: ``host`` is not a str, or ``port`` not an int in [0, 65535].
    """
    if not isinstance(host, str):  # untyped callers
        raise ValueError(f"`host` must be a str, but is {host!r} instead.")
    check_host(host)
    number: object = port  # untyped callers
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= 65535:
        raise ValueError(f"`port` must be an int in [0, 65535], but is {port!r} instead.")
    flag: object = allow_all_interfaces  # untyped callers
    if not isinstance(flag, bool):
        raise ValueError(f"`allow_all_interfaces` must be a bool, but is {flag!r} instead.")
    everywhere = _means_every_interface(host)
    if everywhere and not allow_all_interfaces:
        raise StoreUsageError(
            f"--host {host} would listen on every interface of this machine, and the store "
            f"has no authentication: anyone who can reach its port there can join or "
            f"disrupt the job (read and write every key, take a rank's place). Give one "
            f"address, e.g. the cluster's private network address or 127.0.0.1; or, where "
            f"every network that reaches this machine is trusted, pass "
            f"{ALL_INTERFACES_FLAG}."
        )
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("serve_store must run on the main thread (it handles signals).")
    out = sys.stdout if out is None else out
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s agang store: %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    # On the package's logger, which every agang logger propagates to: the store's own
    # records and those of set-up's code it runs (binding the address) reach stderr.
    package = logging.getLogger("agang")
    package.addHandler(handler)
    old_level = package.level
    package.setLevel(logging.INFO)
    try:
        listener = _bind(host, port)
        if everywhere:
            log.warning(
                "listening on every interface (--host %s, %s): the store has no "
                "authentication, so anyone who can reach port %d can join or disrupt the job.",
                host,
                ALL_INTERFACES_FLAG,
                listener.getsockname()[1],
            )
        return _serve(listener, out)
    finally:
        package.removeHandler(handler)
        package.setLevel(old_level)


def _serve(listener: socket.socket, out: TextIO) -> int:
    import torch.distributed as dist

    bound: Endpoint = (_normal(listener.getsockname()[0]), listener.getsockname()[1])
    received: list[int] = []
    wakeup_reader, wakeup_writer = socket.socketpair()
    previous: dict[int, Any] = {}

    def note(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        if signum == signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
            continue  # rule 3: a background job of a script keeps ignoring Ctrl-C
        previous[signum] = signal.signal(signum, note)
    for end in (wakeup_reader, wakeup_writer):
        end.setblocking(False)
    old_wakeup = signal.set_wakeup_fd(wakeup_writer.fileno(), warn_on_full_buffer=False)
    fd = listener.detach()  # the store owns it from here
    store: Any = None
    try:
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                bound[0],
                bound[1],
                None,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=fd,
                timeout=timedelta(seconds=60),
            )
        except BaseException:
            os.close(fd)
            raise
        print(f"agang store listening on {format_endpoint(bound)}", file=out, flush=True)
        watcher = ConnectionWatcher(bound)
        if not watcher.available:
            log.warning("joins and leaves are not logged: %s is not readable here.", _TABLES[0])
        while not received:
            select.select([wakeup_reader], [], [], POLL_SECONDS)
            with contextlib.suppress(OSError):
                wakeup_reader.recv(4096)
            try:
                joined, left = watcher.poll()
            except Exception as error:  # a table this code cannot read: keep serving
                log.warning("joins and leaves are no longer logged: %r", error)
                watcher.available = False
                continue
            _log_changes("left", left, len(watcher.connected))
            _log_changes("joined", joined, len(watcher.connected))
        log.info("%s received; stopping.", signal.Signals(received[0]).name)
    finally:
        del store  # closes the port (c10d's server stops with its last reference)
        signal.set_wakeup_fd(old_wakeup)
        for number, earlier in previous.items():
            signal.signal(number, earlier)
        wakeup_reader.close()
        wakeup_writer.close()
    print("agang store stopped", file=out, flush=True)
    return 0
