"""Loopback ports for tests: free ones, found by binding 127.0.0.1 only."""

from __future__ import annotations

import random
import socket


def free_port(low: int = 0, high: int = 0) -> int:
    """A port on 127.0.0.1 that was free a moment ago.

    By default a random one below the kernel's ephemeral range, never the kernel's own
    pick: a port from that range may be handed, between this probe and a later bind, to
    any outgoing connection on the machine as its source port (CI once saw a test that
    re-hosts a store on one port 40 times fail with "in use" so). With ``low`` and
    ``high``, random ports in [low, high) are tried. Callers that bind it later accept
    the small race with other tests.
    """
    if (low, high) == (0, 0):
        low, high = 20000, _ephemeral_low()
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError(f"no free port found in [{low}, {high})")


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            low = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return max(low, 20001)


def rank_env(rank: int, port: int, world_size: int = 2, *, agent_store: bool) -> dict[str, str]:
    """The torchrun-style environment of one local rank on 127.0.0.1:``port``; with
    ``agent_store`` it joins a store hosted elsewhere (the test's, or a process of its
    own), as torchrun's agent store is joined; without, rank 0 hosts agang's own."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env
