"""Epoch gangs over NCCL: an NCCL communicator of a membership's own, made from the store,
for channels whose tensors are on a GPU (or on the simulated NCCL).

The NCCL twin of ``agang._setup.epoch_gang`` (whose rules 1, 2 and 4 hold here too: the
group is registered nowhere and never the default group, its gang's timeout aborts it,
its errors name members, c10d's timeout sits behind agang's deadlines). What NCCL adds:
1. The communicator is connected when the gang is made, on the caller's thread (set-up's
   own, never a round's loop): a missing member fails the round's set-up within its
   deadline, not the first broadcast of the round.
2. NCCL's settings are agang's (``agang._setup.process``: the watchdog's error handling
   that leaves the process alive, and the rest), applied where the user left them unset,
   before the group is made: a trainer or server that opens a channel without
   ``agang.init`` gets them too.
3. An NCCL communicator never shrinks: a member dropped from a round leaves its gang
   aborted (its kernels exit) and closed, and the next round runs on a new communicator,
   as every membership change already makes a new epoch gang.
4. On a GPU the group is c10d's ``ProcessGroupNCCL`` on the channel's device, and its one
   store key is its communicator's id (``0``, c10d's counter of the group's communicators;
   read from c10d's source, not yet measured on a GPU). On the CPU, which real NCCL never
   runs on, it is the simulated NCCL's (``AGANG_SIM_NCCL=1``): a ``SimNcclProcessGroup``
   on the process's simulated device, whose wire, a Gloo group under ``wire``, leaves
   Gloo's key per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, final

import torch
import torch.distributed as dist

from agang._backends.c10d.calls import connect_eagerly
from agang._backends.sim_nccl.c10d_group import SimNcclProcessGroup
from agang._backends.sim_nccl.process import ProcessSimulation
from agang._collective.process_group_gang import ProcessGroupGang
from agang._membership.member import Member
from agang._setup.epoch_gang import epoch_gang_over, wrap
from agang._setup.process import apply_nccl_settings


@final
class NcclEpochGangs:
    """Makes epoch gangs over NCCL, or over the simulated NCCL where this process runs it
    (module rules).

    Args:
        device: The channel's device: its tensors', where the gangs' ops run.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device

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
        # The settings agang.init makes (c10d's watchdog must not end the process before
        # a round's deadline aborts the communicator), for a process that never called it.
        apply_nccl_settings(os.environ)
        group_store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        backstop = timedelta(seconds=max(1.0, timeout))
        group = nccl_group(group_store, rank, len(members), backstop, name, self._device)
        return epoch_gang_over(group, self._device, "nccl", name, members, op_timeout)

    def rendezvous_keys(self, size: int) -> list[str]:
        if self._device.type == "cpu":  # rule 4
            return [f"wire/0/{rank}" for rank in range(size)]
        return ["0"]


def nccl_group(
    store: Any, rank: int, size: int, timeout: timedelta, name: str, device: torch.device
) -> dist.ProcessGroup:
    """An NCCL group registered nowhere, made on ``store`` (the epoch's prefix) and
    connected (rules 1 and 4): on a GPU c10d's, on the CPU the simulated NCCL's."""
    if device.type == "cpu":
        simulation = ProcessSimulation.install()
        return SimNcclProcessGroup(
            store,
            rank,
            size,
            timeout,
            device=simulation.device,
            runtime=simulation.runtime,
            name=name,
        )
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(store, rank, size, options)
    group = wrap(nccl, dist.ProcessGroup.BackendType.NCCL, store, device, name)
    connect_eagerly(group, device)
    return group
