"""How a membership makes each epoch's gang: the one interface its factories share.

A feature that leads its own epochs (the weights channel) never makes a process group
itself: it asks a factory for a [`agang.Gang`][agang.Gang] over the epoch's members, and runs
its rounds on that gang's public interface (its collectives, ``close``, ``holds``). The
factory decides the transport: c10d's Gloo over the store (``agang._setup.
epoch_gang``), or a simulation in one process for tests (``agang.testing``).

Rules of a factory:
1. It is called on a thread of its own, never on an event loop, by every member with
   its rank (its position in ``members``); it blocks until every member has called it,
   and raises once ``timeout`` seconds passed without them: a missing member fails the
   epoch's set-up, not a later collective.
2. The gang is the epoch's alone: never the process's default group, so that a member
   that has a gang of its own (a trainer's, an elastic one) keeps it.
3. Its errors name a rank by its member's name and where it runs.
4. Its ops' deadlines default to ``op_timeout`` (None: none), and a deadline that
   passes aborts it (its peers' ops then fail instead of hanging).
5. ``rendezvous_keys(size)``: the keys, under the epoch's prefix, that making a gang of
   ``size`` leaves in the store, so that whoever forgets the epoch deletes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from agang._gang import Gang
from agang._membership.member import Member


class GangFactory(Protocol):
    """Makes one epoch's gang (module rules)."""

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
    ) -> Gang:
        """The gang of ``members`` for this member (``rank``), its rendezvous under
        ``prefix`` on ``store``; blocks until every member came, or ``timeout`` passed."""
        ...

    def rendezvous_keys(self, size: int) -> list[str]:
        """The keys under the prefix that making a gang of ``size`` leaves (rule 5)."""
        ...
