"""Meeting the other ranks: the store, then a check-in that names whoever is missing.

Rules (all of this runs on init's daemon thread, never on the loop):
1. Rank 0 hosts the TCP store unless the launcher does (torchrun's agent); the others
   connect to it. One connection attempt gets at most ATTEMPT_SECONDS; transient
   failures are retried by the caller's policy within the init deadline.
2. A port agang derived itself (SLURM) is a first choice, not a promise: if it is taken,
   the host takes the next free one of PORT_CANDIDATES and marks its store with the
   job's token, and the others try the same ports in order, keeping the store that
   carries their token. A port the user fixed is never moved: "in use" fails at once.
3. Every rank checks in under its own key, ``<prefix>/rank/<r>``, with its world size,
   host and pid. A deadline then names exactly the ranks that never did: the host
   publishes the list (``<prefix>/missing``) HOST_LINGER before its deadline (at most
   half the time it has left) and keeps its store up until the deadline, so the others
   learn it too, and the deadline stays the deadline. A rank with time left takes that
   as the end of a round and joins the next one (a re-init after a failure); one near
   its own deadline fails too. A second check-in for the same rank (two processes
   started with one RANK) and ranks that disagree on the world size fail at once.
4. Keys live under a prefix per launcher restart and per init call, so a retry or a
   re-init never reads a failed attempt's keys.
5. Waiting polls with back-off up to WAIT_SLICE seconds, so a cancelled init stops soon.
6. Once its group is made, the host marks the round over on its store (an empty
   ``<prefix>/missing``). A rank that reaches that store later, starting its next init
   while this one is still being closed, gets a transient error and finds the new store
   instead of the old round's keys.
7. The store rank 0 hosts listens on ``MASTER_ADDR``'s address only (a socket agang
   binds and hands to c10d), not on every interface of the host; where ``MASTER_ADDR``
   is not an address of this host (a NAT or DNS alias), on every interface, as c10d does.
8. Every c10d call here goes through ``agang._backends.c10d.retry.call_c10d``, so its
   transient failures are a ``agang._backends.c10d.retry.TransientSetupError``; agang's own
   transient conditions raise that type directly.
9. Each rank checks in with the interface its connections leave from (address and
   network); the ranks learn each other's, for messages that name where a rank runs,
   and warn when they are on different networks.
10. Opening the store (hosting it, or connecting) keeps c10d's C++ log quiet
   (``agang._backends.c10d.log``): each retry is one INFO line of agang's instead of
   c10d's stack traces.
11. Meeting ends with proof: a barrier on the new default group (``prove``), within
   the set-up's deadline, and the group destroyed if it fails. It lives here, not in
   init, because both init and an elastic re-formation end their meeting with it.
12. Each rank checks in with the init settings every rank must share (``check_order``,
   which makes a side group on every rank or on none, and the backend); a rank that
   finds another's different fails at once, naming the setting and both values, rather
   than waiting at a set-up step the others never reach until the deadline.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from agang._backends.c10d.log import quiet_c10d
from agang._backends.c10d.retry import (
    PortInUseError,
    RetryPolicy,
    TransientSetupError,
    call_c10d,
    is_address_in_use,
    retrying,
)
from agang._errors import GangInitError, one_line
from agang._runtime.threads import start_thread
from agang._setup.env import WorldInfo
from agang._setup.interface import Link, disagreement

log = logging.getLogger("agang.setup")

ATTEMPT_SECONDS = 2.0
PORT_CANDIDATES = 8
WAIT_SLICE = 0.25
# After its deadline the host keeps its store up this long, so that ranks still waiting
# can read who was missing.
HOST_LINGER = 0.5
#: The most the proving barrier waits (seconds), within the set-up's deadline (rule 11).
BARRIER_SECONDS = 30.0
_OWNER_KEY = "agang/owner"


class InitCancelled(Exception):
    """The caller stopped waiting for init; the thread winds down."""


def _token(world: WorldInfo) -> str:
    return f"agang job={world.job_id} size={world.world_size}"


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=max(0.05, value))


def open_store(
    world: WorldInfo,
    *,
    deadline: float,
    policy: RetryPolicy,
    cancelled: threading.Event,
    on_attempt: Callable[[], None] = lambda: None,
    then: Callable[[Any], None] = lambda store: None,
) -> tuple[Any, int]:
    """Connects to (or hosts) the store, retrying transient failures (rules 1, 2).

    Args:
        on_attempt: Called before each attempt, so a failure can say how many were made.
        then: Run on the store within the same attempt (the check-in): if the store goes
            away meanwhile (a failed attempt's host closing it), the whole attempt is
            retried, so a rank never stays with a dying store.

    Returns:
        The store, and the port it is on.
    """
    started = time.monotonic()

    def say_retry(number: int, error: BaseException, pause: float) -> None:
        log_retry(world, number, error, pause, time.monotonic() - started)

    for attempt in retrying(policy, deadline, on_retry=say_retry):
        with attempt:
            on_attempt()
            if cancelled.is_set():
                raise InitCancelled
            with quiet_c10d():  # rule 10
                store, port = _open_once(world, deadline)
            try:
                then(store)
            except BaseException:
                store = None  # let a hosted store go with the failed attempt
                raise
    return store, port


def log_retry(
    world: WorldInfo, attempt: int, error: BaseException, pause: float, elapsed: float
) -> None:
    """Says, in one INFO line, that opening the store failed transiently and when the
    next attempt is (rule 10)."""
    cause = error.__cause__ if error.__cause__ is not None else error
    log.info(
        "agang: rank %d of %d: attempt %d at the store %s failed after %.1f s: %s; "
        "retrying in %.1f s.",
        world.rank,
        world.world_size,
        attempt,
        world.store_address,
        elapsed,
        one_line(cause).rstrip("."),
        pause,
    )


def _open_once(world: WorldInfo, deadline: float) -> tuple[Any, int]:
    ports = [world.master_port]
    if world.port_is_derived:
        ports = [world.master_port + i for i in range(PORT_CANDIDATES)]
    remaining = deadline - time.monotonic()
    if world.rank == 0 and not world.launcher_hosts_store:
        for port in ports:
            try:
                store = _host(world, port, remaining)
            except Exception as error:
                if is_address_in_use(error) and world.port_is_derived:
                    continue
                if is_address_in_use(error):
                    raise PortInUseError(
                        f"`MASTER_PORT` must be a free port on this host, but {port} is in use "
                        f"by another process: pick another port, the same on every rank.",
                        port_is_ours=False,
                    ) from error
                raise
            call_c10d(store.set, _OWNER_KEY, _token(world))
            return store, port
        raise PortInUseError(
            f"The ports {ports[0]}-{ports[-1]} agang derived are all in use.", port_is_ours=True
        )
    # At most half of what is left, so a deadline always leaves room for another try.
    budget = min(ATTEMPT_SECONDS, max(0.05, remaining / 2)) / len(ports)
    last_error: BaseException | None = None
    for port in ports:
        try:
            store = _connect(world, port, budget)
        except Exception as error:
            last_error = error
            continue
        if store is None:
            continue  # a store, but another job's
        call_c10d(store.set_timeout, _seconds(deadline - time.monotonic()))
        return store, port
    assert last_error is not None or world.port_is_derived
    raise last_error or TransientSetupError(
        f"No store of this job answered on ports {ports[0]}-{ports[-1]} (it may not be up yet)."
    )


def _host(world: WorldInfo, port: int, remaining: float) -> Any:
    """Hosts the store on ``port``, listening on ``MASTER_ADDR`` only (rule 7)."""
    listener = listen_on(world.master_addr, port)
    if listener is None:
        log.warning(
            "agang: MASTER_ADDR %s is not one address of this host (a NAT or DNS alias, or "
            "a name for loopback and the network both): the store listens on every "
            "interface.",
            world.master_addr,
        )
    fd = None if listener is None else listener.detach()  # the store owns it from here
    try:
        return call_c10d(
            dist.TCPStore,  # type: ignore[attr-defined]
            world.master_addr,
            port if fd is None else _bound_port(fd),
            world.world_size,
            is_master=True,
            timeout=_seconds(remaining),
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def listen_on(host: str, port: int) -> socket.socket | None:
    """A listening socket on ``host``'s address (IPv4 first); None where ``host`` is not
    an address of this host, or names loopback and other addresses at once. Raises
    ``OSError`` (``EADDRINUSE``) for a taken port."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    loopback = {ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos}
    if len(loopback) > 1:
        return None  # a name for loopback and the network both: clients may try either
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    for family, kind, proto, _, where in infos:
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            listener.listen(socket.SOMAXCONN)
            return listener
        except OSError as error:
            listener.close()
            if error.errno == errno.EADDRINUSE:
                raise
    return None


def _bound_port(fd: int) -> int:
    with socket.socket(fileno=os.dup(fd)) as view:
        return int(view.getsockname()[1])


def _connect(world: WorldInfo, port: int, budget: float) -> Any:
    def connect() -> Any:
        return call_c10d(
            dist.TCPStore,  # type: ignore[attr-defined]
            world.master_addr,
            port,
            world.world_size,
            is_master=False,
            timeout=_seconds(budget),
        )

    if not world.port_is_derived:
        return connect()

    def connect_to_ours() -> Any:
        store = connect()
        return store if _carries_token(store, world) else None

    # A derived port may belong to a foreign listener. c10d's client can then block on
    # it well past its own timeout (PyTorch PR 129261), in the handshake or in the first
    # read, so the whole probe runs on a daemon thread that is given up on after the
    # budget; one stuck there ends with that listener.
    probe = start_thread(connect_to_ours, name=f"probe store port {port}")
    try:
        return probe.wait(budget + 0.5)
    except TimeoutError:
        raise TransientSetupError(
            f"Port {port} answers, but not as this job's store within {budget:.2f} s."
        ) from None


def _carries_token(store: Any, world: WorldInfo) -> bool:
    try:
        return bool(store.check([_OWNER_KEY])) and store.get(_OWNER_KEY).decode() == _token(world)
    except Exception:
        return False


def end_round(store: Any, world: WorldInfo, prefix: str) -> None:
    """Marks a successful round over on its store (rule 6), on the host only."""
    if world.rank == 0 and not world.launcher_hosts_store:
        store.set(f"{prefix}/missing", "")


def prove(deadline: float) -> None:
    """A barrier on the new default group, before any gang exists (so it takes no seq
    number); the group is destroyed if it fails (rule 11)."""
    options = dist.BarrierOptions()
    seconds = max(0.1, min(BARRIER_SECONDS, deadline - time.monotonic()))
    options.timeout = timedelta(seconds=seconds)
    try:
        dist.distributed_c10d._get_default_group().barrier(options).wait(timedelta(seconds=seconds))
    except BaseException:
        dist.destroy_process_group()
        raise


def clear_frames(error: BaseException) -> None:
    """Drops the frames of ``error`` and its causes: their locals (a hosted store, its
    port) would otherwise live as long as the caller keeps the error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def check_in(
    store: Any,
    world: WorldInfo,
    prefix: str,
    *,
    deadline: float,
    cancelled: threading.Event,
    on_missing: Callable[[list[int]], None] = lambda missing: None,
    link: Link | None = None,
    settings: Mapping[str, str] | None = None,
) -> list[Member]:
    """Checks this rank in and waits for every other rank (rules 3, 5); returns every
    rank's host, pid and interface, as they checked in (rule 9). ``settings`` must be
    equal on every rank (rule 12: init's ``check_order`` and backend).

    Raises:
        GangInitError: The deadline passed (``missing_ranks`` says who never came), the
            rank checked in twice, or the ranks disagree on the world size.
        TransientSetupError: The store is closing or its round is over (the next attempt
            finds the new one), or c10d's connection to it failed transiently.
    """
    members: list[Member] = call_c10d(
        _check_in,
        store,
        world,
        prefix,
        deadline=deadline,
        cancelled=cancelled,
        on_missing=on_missing,
        link=link or Link(None, None, None),
        settings=_settings_text(settings or {}),
    )
    warning = disagreement({r: m.link for r, m in enumerate(members)})
    # Rank 0 says so, and each rank that differs from it: not a thousand times over.
    if warning and (world.rank == 0 or members[world.rank].link.network != members[0].link.network):
        log.warning("%s", warning)
    return members


def _check_in(
    store: Any,
    world: WorldInfo,
    prefix: str,
    *,
    deadline: float,
    cancelled: threading.Event,
    on_missing: Callable[[list[int]], None],
    link: Link,
    settings: str,
) -> list[Member]:
    # Every store operation below is a c10d call: check_in classifies their failures.
    verdict = f"{prefix}/missing"
    if store.check([verdict]):
        # This store belongs to an attempt that already failed and is closing: the next
        # attempt finds the new one.
        raise TransientSetupError(
            f"The store at {world.store_address} is closing: its host gave up on an "
            f"earlier attempt."
        )
    me = f"{world.world_size} {socket.gethostname()} {os.getpid()} {settings} {link.to_text()}"
    key = f"{prefix}/rank/{world.rank}"
    # A second claim is a duplicate rank, unless it is this process retrying an attempt.
    if store.add(f"{prefix}/claim/{world.rank}", 1) > 1 and not (
        store.check([key]) and store.get(key).decode() == me
    ):
        raise GangInitError(
            f"`RANK` must be unique, but rank {world.rank} checked in twice: two processes "
            f"were started with the same rank (or another process that reaches the store "
            f"at MASTER_ADDR:MASTER_PORT claimed it: the store has no authentication)."
        )
    store.set(key, me)
    keys = [f"{prefix}/rank/{rank}" for rank in range(world.world_size)]
    is_host = world.rank == 0 and not world.launcher_hosts_store
    # The host's verdict comes before its deadline, which lingering must not pass (rule 3).
    linger = min(HOST_LINGER, max(0.0, deadline - time.monotonic()) / 2) if is_host else 0.0
    waits_until = deadline - linger
    # Polled with check(), not store.wait(): c10d logs a warning at every timed-out wait.
    pause = 0.01
    while not store.check(keys):
        if cancelled.is_set():
            raise InitCancelled
        if not is_host and store.check([verdict]):
            text = store.get(verdict).decode()
            if not text:
                raise TransientSetupError(
                    f"The store at {world.store_address} belongs to a finished round."
                )
            missing = [int(r) for r in text.split(",")]
            on_missing(missing)
            if deadline - time.monotonic() > 2 * HOST_LINGER:
                # The host ended this round, but this rank has time left: join the next
                # round (a transient error, so the attempt is retried).
                raise TransientSetupError(
                    f"The store host ended its round without ranks {missing}; this rank "
                    f"joins the next one."
                )
            raise GangInitError(
                f"Ranks {missing} of {world.world_size} did not check in at the store "
                f"{world.store_address} before the store host's deadline.",
                missing_ranks=missing,
            )
        if time.monotonic() >= waits_until:
            break
        time.sleep(min(pause, max(0.0, waits_until - time.monotonic())))
        pause = min(pause * 2, WAIT_SLICE)
    missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
    if missing and is_host:
        # Tell the ranks that are still waiting who never came, and keep the store up for
        # them to read it (they may have started a little after this one).
        store.set(verdict, ",".join(map(str, missing)))
        while (left := deadline - time.monotonic()) > 0 and not cancelled.is_set():
            time.sleep(min(0.05, left))
    if missing:
        raise GangInitError(
            f"Ranks {missing} of {world.world_size} did not check in at the store "
            f"{world.store_address} before the deadline.",
            missing_ranks=missing,
        )
    members = []
    for rank, key in enumerate(keys):
        size, host, pid, theirs, rest = [*store.get(key).decode().split(" ", 4), "", "", ""][:5]
        if int(size) != world.world_size:
            raise GangInitError(
                f"`WORLD_SIZE` must be the same on every rank, but is {world.world_size} here "
                f"and {size} on rank {rank}."
            )
        if theirs != settings:  # rule 12
            raise GangInitError(_differing(settings, theirs, world.rank, rank, host, pid))
        members.append(Member(host, int(pid or 0), Link.from_text(rest)))
    return members


def _settings_text(settings: Mapping[str, str]) -> str:
    """``settings`` as one word of the check-in line (rule 12)."""
    return ",".join(f"{name}={value}" for name, value in sorted(settings.items())) or "-"


def _differing(mine: str, theirs: str, me: int, rank: int, host: str, pid: str) -> str:
    """The message for init settings that differ between this rank and ``rank``."""
    ours = dict(part.split("=", 1) for part in mine.split(",") if "=" in part)
    other = dict(part.split("=", 1) for part in theirs.split(",") if "=" in part)
    names = sorted(n for n in {*ours, *other} if ours.get(n) != other.get(n)) or ["settings"]
    said = "; ".join(
        f"`{name}` is {ours.get(name, 'unset')} here (rank {me}) and "
        f"{other.get(name, 'unset')} on rank {rank} ({host}, pid {pid})"
        for name in names
    )
    return (
        f"init's {', '.join(f'`{n}`' for n in names)} must be the same on every rank, "
        f"but {said}: ranks that disagree would wait on each other's set-up until the "
        f"deadline. Pass the same value everywhere (or set AGANG_CHECK_ORDER for the job)."
    )


@dataclass(frozen=True)
class Member:
    """One rank as it checked in: its host's name, its pid, its interface."""

    host: str
    pid: int
    link: Link

    def describe(self) -> str:
        address = f" {self.link.address}" if self.link.address else ""
        return f"{self.host}{address}, pid {self.pid}"
