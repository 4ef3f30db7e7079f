"""Epoch gangs over c10d: a Gloo group of a membership's own, made from the store.

The factory of ``agang._membership.gangs`` that production uses; elastic set-up
makes its epochs' world groups beside it (``agang._setup.elastic``).

Rules:
1. The group is made from the epoch's prefix of the store, as ``init_process_group``
   would make it, but registered nowhere: c10d's default group and agang's world gang
   (one per process) stay the process's own. The gang over it is a ``ProcessGroupGang``
   whose ops have agang's deadlines, and whose timeout aborts the group (on Gloo:
   closes its connections, so the peers' ops fail at once instead of hanging).
2. The group answers no mailbox (its ranks are not the process's world ranks): blame
   is its feature's (the weights' publisher asks its subscribers itself). Its errors
   name a rank by its member's name and where it runs, never by the world's roster.
3. It binds to the interface that reaches the store (as ``init`` chooses it for a
   gang: ``agang._setup.interface``), or the one ``GLOO_SOCKET_IFNAME`` or
   ``AGANG_SOCKET_IFNAME`` names: Gloo's own default, the address this host's name
   resolves to, is loopback on many machines, and a member on another machine was
   then never admitted.
4. c10d's own timeout sits behind the longest deadline of the gang's ops (agang's
   backstop): ``op_timeout``, or none. It matters after a failure: a Gloo send caught
   mid-write outlives the abort until that timeout, and so does the failed gang's
   closing thread (its memory is free at once: ``agang._backends.c10d.completion``
   rule 4).
5. Gloo's context 0 leaves one key per rank under the prefix: ``0/<rank>``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, final

import torch
import torch.distributed as dist

from agang._backends.c10d.backend import C10dBackend
from agang._collective.gang import gang_over
from agang._collective.process_group_gang import ProcessGroupGang
from agang._membership.member import Member
from agang._policy import make_policy
from agang._setup import interface

log = logging.getLogger("agang.setup")


@final
class GlooEpochGangs:
    """Makes epoch gangs over Gloo (module rules).

    Args:
        store_host: The store's host: the group binds to the interface that reaches it
            (rule 3).
    """

    def __init__(self, store_host: str) -> None:
        self._store_host = store_host

    def __call__(
        self,
        store: Any,
        prefix: str,
        *,
        rank: int,
        members: Sequence[Member],
        name: str,
        timeout: float,
        op_timeout: float | None,
    ) -> ProcessGroupGang:
        group_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        backstop = timedelta(seconds=max(1.0, timeout))
        group = gloo_group(group_store, rank, len(members), backstop, self._store_host, name)
        return epoch_gang_over(group, torch.device("cpu"), "gloo", name, members, op_timeout)

    def rendezvous_keys(self, size: int) -> list[str]:
        return [f"0/{rank}" for rank in range(size)]  # rule 5


def wrap(backend: Any, kind: Any, store: Any, device: torch.device, name: str) -> dist.ProcessGroup:
    """A group of c10d's ``backend`` (of ``kind``) on ``device``, registered nowhere, as
    ``new_group`` makes one inside (rule 1)."""
    group = dist.ProcessGroup(store, backend.rank(), backend.size())
    group._register_backend(device, kind, backend)
    group._set_default_backend(kind)
    group._set_group_name(name)  # type: ignore[arg-type]  # a GroupName is a str
    return group


def epoch_gang_over(
    group: dist.ProcessGroup,
    device: torch.device,
    kind: str,
    name: str,
    members: Sequence[Member],
    op_timeout: float | None,
) -> ProcessGroupGang:
    """The gang over an epoch's ``group`` (rules 1, 2 and 4): agang's deadlines, a timeout
    that aborts, members named by name and where they run."""
    backend = C10dBackend(
        group,
        device=device,
        kind=kind,
        name=name,
        is_world=False,
        registered=False,
        roster=[f"'{m.name}', {m.where}" for m in members],
    )
    policy = make_policy(
        op_timeout=math.inf if op_timeout is None else op_timeout,
        on_timeout="abort",
        check_order=False,
    )
    return gang_over(ProcessGroupGang, backend, policy)


def gloo_group(
    store: Any, rank: int, size: int, timeout: timedelta, store_host: str, name: str
) -> dist.ProcessGroup:
    """A Gloo group registered nowhere (rule 1), made on ``store`` (the epoch's prefix)
    and bound to the interface that reaches the store (rule 3); blocks until every rank
    came, or ``timeout`` passed."""
    gloo = _gloo_backend(store, rank, size, timeout, store_host)
    return wrap(gloo, dist.ProcessGroup.BackendType.GLOO, store, torch.device("cpu"), name)


def _gloo_backend(
    store: Any, rank: int, size: int, timeout: timedelta, store_host: str
) -> dist.ProcessGroupGloo:
    """The epoch's Gloo group on the interface that reaches the store (rule 3)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):  # the user's choice: Gloo reads it itself
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    choice = interface.choose_interface(store_host, os.environ)
    if choice.ifname is None:
        log.warning(
            "agang: an epoch's group binds where this host's name resolves: %s. "
            "Set %s if members on other hosts cannot connect.",
            choice.why,
            interface.IFNAME_ENV,
        )
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(interface=choice.ifname)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)
