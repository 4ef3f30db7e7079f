"""Where a channel lives: its store, and how each epoch's gang is made.

Production's site is an ``agang store`` at ``HOST:PORT`` and epoch gangs over it
(``Site.of``); agang's tests run the same publisher and subscribers on an in-process
store and simulated gangs (``agang.testing``), so the round protocol is exercised
without a process of its own.

The transport follows the tensors' device: NCCL epoch gangs for tensors on a GPU, Gloo
for tensors on the CPU, except where this process runs the simulated NCCL
(``AGANG_SIM_NCCL=1``: its CPU tensors stand for a GPU's, as ``agang.init``'s do).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from agang._membership import store as stores
from agang._membership.gangs import GangFactory
from agang._setup import simulation
from agang._setup.epoch_gang import GlooEpochGangs
from agang._setup.nccl_epoch_gang import NcclEpochGangs


@dataclass(frozen=True)
class Site:
    """A channel's store and epoch gangs (module docstring).

    Attributes:
        address: The store's address, for messages.
        connect: A new client of the store, made by a deadline (monotonic seconds);
            called again after the store was lost.
        factory: Makes each epoch's gang.
        transport: ``"gloo"``, ``"nccl"`` or ``"nccl-sim"``: what the factory's gangs
            run on.
    """

    address: str
    connect: Callable[[float], Any]
    factory: GangFactory
    transport: str = "gloo"

    @classmethod
    def of(
        cls, store: str, host: str, port: int, channel: str, who: str, device: torch.device
    ) -> Site:
        """The ``agang store`` at ``store`` (``host``:``port``), with epoch gangs for
        tensors on ``device`` (module docstring)."""
        need = f"The weights channel '{channel}' needs"

        def connect(until: float) -> Any:
            return stores.connect(
                host, port, until, need=need, who=who, op_seconds=stores.OP_SECONDS
            )

        if device.type == "cuda":
            return cls(store, connect, NcclEpochGangs(device), "nccl")
        if simulation.requested(os.environ):  # its own name: it never meets a real NCCL
            return cls(store, connect, NcclEpochGangs(device), "nccl-sim")
        return cls(store, connect, GlooEpochGangs(host), "gloo")
