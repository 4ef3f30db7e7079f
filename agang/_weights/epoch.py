"""One epoch's gang: a Gloo group of the channel's own, never the process's default
group, so that a server or a trainer that has its own gang (elastic or not) keeps it.

Rules:
1. The group is made from the epoch's prefix of the store, as ``init_process_group``
   would make it, but registered nowhere: c10d's default group and agang's world gang
   (one per process) stay the process's own. The gang over it is a ``ProcessGroupGang``
   whose ops have agang's deadlines, and whose timeout aborts the group (on Gloo:
   closes its connections, so the peers' ops fail at once instead of hanging).
2. Blame at the channel's level: the group answers no mailbox (its ranks are not the
   process's world ranks); the publisher asks the subscribers itself
   (:mod:`agang._weights.channel`, rule 5). The gang's errors name a rank by its
   member's name and where it runs, never by the process's world roster.
3. The round's header is bucket 0's first ``HEADER_WORDS`` int64 words: what the round
   is (``DATA``, ``REFORM``: go to the epoch named, ``CLOSE``: the publisher closes),
   the version, the epoch.
4. The group binds to the interface that reaches the store (as ``init`` chooses it for
   a gang: ``agang._setup.interface``), or the one ``GLOO_SOCKET_IFNAME`` or
   ``AGANG_SOCKET_IFNAME`` names: Gloo's own default, the address this host's name
   resolves to, is loopback on many machines, and a subscriber on another machine was
   then never admitted.
5. c10d's own timeout sits behind the longest deadline of the gang's ops (agang's
   backstop): the publisher's are its pushes' (``op_timeout``), a subscriber's have
   none (it waits for the next push as long as it comes). It matters after a failure:
   a Gloo send caught mid-write outlives the abort until that timeout, and so does the
   failed gang's closing thread (its memory is free at once:
   ``agang._backends.c10d.completion`` rule 4).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.c10d.backend import C10dBackend
from agang._collective.process_group_gang import ProcessGroupGang
from agang._policy import make_policy
from agang._setup import interface
from agang._weights.channel import Channel

log = logging.getLogger("agang.weights")

DATA, REFORM, CLOSE = 1, 2, 3


@dataclass
class Member:
    """One member of an epoch: the publisher (rank 0) or a subscriber."""

    uid: str
    name: str
    where: str

    def to_text(self) -> str:
        return f"{self.uid} {self.name} {self.where}"

    @classmethod
    def from_text(cls, text: str) -> Member:
        uid, name, where = text.split(" ", 2)
        return cls(uid, name, where)


def make_gang(
    channel: Channel,
    epoch: int,
    rank: int,
    members: list[Member],
    seconds: float,
    op_timeout: float = math.inf,
) -> ProcessGroupGang:
    """Epoch ``epoch``'s gang of ``members`` (publisher first; rule 1); blocks until
    every member connected, or raises once ``seconds`` passed. Call it off the caller's
    loop. Its errors name a rank by its member's name and where it runs (rule 2).
    ``op_timeout``: the longest deadline its ops will have (rule 5)."""
    store = channel.group_store(epoch)
    size = len(members)
    timeout = timedelta(seconds=max(1.0, seconds))
    gloo = _gloo_group(store, rank, size, timeout, channel.address.rsplit(":", 1)[0])
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    name = f"weights:{channel.name}:{channel.session}:{epoch}"
    group._set_group_name(name)  # type: ignore[arg-type]  # a GroupName is a str
    backend = C10dBackend(
        group,
        device=torch.device("cpu"),
        kind="gloo",
        name=name,
        is_world=False,
        registered=False,
        roster=[f"'{m.name}', {m.where}" for m in members],
    )
    policy = make_policy(op_timeout=op_timeout, on_timeout="abort", check_order=False)
    return ProcessGroupGang._from_backend(backend, policy)


def _gloo_group(
    store: Any, rank: int, size: int, timeout: timedelta, store_host: str
) -> dist.ProcessGroupGloo:
    """The epoch's Gloo group on the interface that reaches the store (rule 4)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # the user's choice: Gloo reads it itself
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    choice = interface.choose_interface(store_host, os.environ)
    if choice.ifname is None:
        log.warning(
            "agang: a weights epoch's group binds where this host's name resolves: %s. "
            "Set %s if subscribers on other hosts cannot connect.",
            choice.why,
            interface.IFNAME_ENV,
        )
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(interface=choice.ifname)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)
