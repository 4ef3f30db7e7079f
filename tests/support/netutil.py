"""Loopback ports for tests: free ones, found by binding 127.0.0.1 only."""

from __future__ import annotations

import random
import socket


def free_port(low: int = 1024, high: int = 65535) -> int:
    """A port on 127.0.0.1 that was free a moment ago.

    With the default range the kernel picks it (port 0); with a narrower one, random
    ports in it are tried. Callers that bind it later accept the small race.
    """
    for _ in range(200):
        port = 0 if (low, high) == (1024, 65535) else random.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError(f"no free port found in [{low}, {high})")


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
