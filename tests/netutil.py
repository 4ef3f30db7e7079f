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


def agent_store_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """The environment of one local rank joining a store hosted elsewhere on 127.0.0.1
    (the test's, or a process of its own), as torchrun's agent store is joined."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
