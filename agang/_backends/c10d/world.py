"""Naming the peer behind a c10d failure.

Gloo's errors name the peer by its socket address ("Connection closed by peer
[10.201.0.2]:42921"), not by rank. Each rank checked in with the address its
connections leave from (``agang._setup.rendezvous``), so the address says which ranks
it can be: one rank where it runs alone on its host, else the ranks sharing that host.

Rules:
1. Only an address that is some other rank's checked-in address is named; loopback,
   which every rank on one host shares, names all the others there.
2. The ranks are the gang's own (a sub-gang's), mapped from world ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: Set by init: the address each world rank's connections leave from (None: unknown).
addresses: list[str | None] = []

_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_peer(
    error: BaseException, world_ranks: list[int], me: int, where: Callable[[int], str]
) -> str:
    """A sentence naming the ranks other than ``me`` at the address ``error`` names, or
    "" (rules 1, 2)."""
    found = _PEER.search(str(error))
    if found is None or not addresses:
        return ""
    address = found.group(1).removeprefix("::ffff:")
    ranks = [
        rank
        for rank, world_rank in enumerate(world_ranks)
        if rank != me and 0 <= world_rank < len(addresses) and addresses[world_rank] == address
    ]
    if not ranks:
        return ""
    if len(ranks) == 1:
        return f" The peer at {address} is {where(ranks[0])}."
    named = ", ".join(where(rank) for rank in ranks)
    return f" The peer at {address} is one of {named}."
