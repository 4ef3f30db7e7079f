"""What set-up learned about the world: where each rank runs, and where its store is.

Set-up (``agang._setup.init``, and the elastic set-up at each epoch) learns facts that
the c10d backend needs long after: where each world rank runs, to name it in a
timeout's blame; the address its connections leave from, to name the peer behind a
Gloo error; the store's address, to name it when it does not answer; whether this
process hosts the store; and, for an elastic gang, the epoch's store that the ranks'
mailboxes live on (``agang._backends.c10d.mailbox``).

Rules:
1. The facts are one ``World`` record, frozen, replaced whole: set-up calls
   ``publish(World(...))`` once it knows them, ``forget()`` where agang did not set the
   world up (``torch.distributed`` already initialized: nothing is known). Every field
   a set-up does not learn keeps its default, so nothing of an earlier world (an
   elastic epoch's store, a plain init's addresses) outlives the next set-up.
2. Readers take ``current()`` and read that record: never half of one world and half of
   the next.
3. A child made by ``os.fork()`` forgets the record (``agang._runtime.fork``): the
   parent's ranks and store are not the child's, and the child's own ``agang.init()``
   publishes its world.

Naming the peer behind a c10d failure: Gloo's errors name the peer by its socket
address ("Connection closed by peer [10.201.0.2]:42921"), not by rank. Each rank checked
in with the address its connections leave from (``agang._setup.rendezvous``), so the
address says which ranks it can be: one rank where it runs alone on its host, else the
ranks sharing that host.

4. Only an address that is some other rank's checked-in address is named; loopback,
   which every rank on one host shares, names all the others there.
5. The ranks are the gang's own (a sub-gang's), mapped from world ranks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from agang._runtime import fork


@dataclass(frozen=True)
class World:
    """What set-up learned about the world (rule 1); the defaults: nothing known."""

    #: Where each world rank runs ("host, address, pid"), as it checked in.
    roster: tuple[str, ...] = ()
    #: The address each world rank's connections leave from (None: unknown).
    addresses: tuple[str | None, ...] = ()
    #: The store's ``host:port``, for messages.
    store_address: str = "of the default group"
    #: Whether this process hosts the store (it stops every rank's mailbox before the
    #: store goes).
    hosts_store: bool = False
    #: The store the ranks' mailboxes live on where it is not the default group's: an
    #: elastic epoch's, under the epoch's prefix.
    store_override: Any = None
    #: This process's world rank where the world is not c10d's default group (a
    #: private world: ``agang._setup.elastic``, rule 9); None: the default group's.
    rank: int | None = None


_current = World()


def publish(world: World) -> None:
    """Makes ``world`` what every reader sees from now on (rule 1)."""
    global _current
    _current = world


def forget() -> None:
    """A world agang did not set up: nothing is known of where its ranks run (rule 1)."""
    publish(World())


def current() -> World:
    """The world as set-up last published it (rule 2)."""
    return _current


fork.on_fork_in_child(forget)  # rule 3


def shared_store() -> Any:
    """The store every rank of the world reaches: an elastic epoch's or a private
    world's (``store_override``), else the default group's; None where there is none."""
    override = _current.store_override
    if override is not None:
        return override
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group: a world agang did not set up
        return None


def world_ranks(group: dist.ProcessGroup, registered_child: bool) -> list[int]:
    """The world rank of each of ``group``'s ranks (a child's, through c10d)."""
    if registered_child:
        return list(dist.get_process_group_ranks(group))
    return list(range(group.size()))


def where(world_ranks: list[int], rank: int) -> str:
    """``rank`` of a gang, named with where its process runs when set-up learned it."""
    roster = _current.roster
    world_rank = world_ranks[rank] if 0 <= rank < len(world_ranks) else -1
    if 0 <= world_rank < len(roster) and roster[world_rank]:
        return f"rank {rank} ({roster[world_rank]})"
    return f"rank {rank}"


_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_peer(
    error: BaseException, world_ranks: list[int], me: int, where: Callable[[int], str]
) -> str:
    """A sentence naming the ranks other than ``me`` at the address ``error`` names, or
    "" (rules 4, 5)."""
    addresses = _current.addresses
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
