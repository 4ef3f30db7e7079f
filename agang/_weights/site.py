"""Where a channel lives: its store, and how each epoch's gang is made.

Production's site is an ``agang store`` at ``HOST:PORT`` and Gloo epoch gangs over it
(``Site.of``); agang's tests run the same publisher and subscribers on an in-process
store and simulated gangs (``agang.testing``), so the round protocol is exercised
without a process of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agang._membership import store as stores
from agang._membership.gangs import GangFactory
from agang._setup.epoch_gang import GlooEpochGangs


@dataclass(frozen=True)
class Site:
    """A channel's store and epoch gangs (module docstring).

    Attributes:
        address: The store's address, for messages.
        connect: A new client of the store, made by a deadline (monotonic seconds);
            called again after the store was lost.
        factory: Makes each epoch's gang.
    """

    address: str
    connect: Callable[[float], Any]
    factory: GangFactory

    @classmethod
    def of(cls, store: str, host: str, port: int, channel: str, who: str) -> Site:
        """The ``agang store`` at ``store`` (``host``:``port``), with Gloo epoch gangs."""
        need = f"The weights channel '{channel}' needs"

        def connect(until: float) -> Any:
            return stores.connect(
                host, port, until, need=need, who=who, op_seconds=stores.OP_SECONDS
            )

        return cls(store, connect, GlooEpochGangs(host))
