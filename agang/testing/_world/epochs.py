"""Epoch gangs in one process: the membership layer's gang factory over FakeWorld, with
the faults a cluster has, so that a feature that leads its own epochs (the weights
channel) runs its whole round protocol in a test, without a process of its own.

Rules:
1. ``FakeEpochs`` makes each epoch's gangs as ``agang._membership.gangs`` asks: every
   member calls it with its rank, each call blocks until every member came, or raises
   once ``timeout`` passed (naming who did not come). The gangs are ``FakeWorldGang``s
   over one communicator per epoch: the engine, deadlines, blame texts and busy
   tensors are production's.
2. *Connections, as Gloo's.* A member whose gang aborts or closes with ops pending
   (a deadline, a failure, a close) closes its connections: its peers' ops that wait
   on it fail at once, and so do their later ops with it, as a Gloo peer's ops fail
   when a pair closes. (Plain FakeWorld only takes the member's own ops back.)
3. *Faults.* ``kill(uid, why)`` is a member's death: every epoch it belongs to loses
   it as in rule 2. ``stall(uid)`` is a member that stops (SIGSTOP, a cut link): its
   ops wait at their meeting for ever, its peers' ops with it too, until a deadline
   passes (``resume`` lets them meet again).
4. A member's beats and answers go through the store, which the test holds: a test
   stops a member's threads itself (what a death or a pause does to them).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, final

import torch

from agang._errors import GangError, GangInitError
from agang._membership.member import Member
from agang._policy import make_policy
from agang.testing._world.backend import Communicator, Simulation
from agang.testing._world.compute import Arrival
from agang.testing._world.gang import FakeWorldGang


@dataclass
class _Linked(Communicator):
    """A communicator whose members' connections close as Gloo's do (rules 2, 3)."""

    #: Members whose connections are closed, and why.
    gone: dict[int, str] = field(default_factory=dict)
    #: Members that stopped: their ops wait at their meeting (rule 3).
    stalled: set[int] = field(default_factory=set)
    held: list[tuple[str, Any]] = field(default_factory=list)

    def _refused(self, rank: int) -> GangError | None:
        peers = {r: why for r, why in self.gone.items() if r != rank}
        if not peers:
            return None
        text = "; ".join(f"rank {r}: {why}" for r, why in sorted(peers.items()))
        return GangError(f"Connection closed by peer ({text}).")

    def arrive(self, index: int, arrival: Arrival) -> None:
        with self.world.lock:
            if arrival.rank in self.stalled:
                self.held.append(("arrive", (index, arrival)))
                return
            refused = self._refused(arrival.rank)
        if refused is not None:
            self.world.schedule(functools.partial(arrival.done, refused))
            return
        super().arrive(index, arrival)

    def point_to_point(
        self, kind: str, pair: tuple[int, int], tensor: torch.Tensor, done: Any
    ) -> None:
        mine = pair[0] if kind == "send" else pair[1]
        other = pair[1] if kind == "send" else pair[0]
        with self.world.lock:
            if mine in self.stalled:
                self.held.append(("p2p", (kind, pair, tensor, done)))
                return
            why = self.gone.get(other)
        if why is not None:
            error = GangError(f"Connection closed by peer (rank {other}: {why}).")
            self.world.schedule(functools.partial(done, error))
            return
        super().point_to_point(kind, pair, tensor, done)

    def withdraw(self, rank: int) -> list[Any]:
        """``rank`` aborted or closed: its own ops are taken back, and its connections
        close (rule 2)."""
        dones = super().withdraw(rank)
        with self.world.lock:  # its ops held while it was stalled: taken back too
            for what, args in list(self.held):
                if what == "arrive" and args[1].rank == rank:
                    dones.append(args[1].done)
                    self.held.remove((what, args))
                elif what == "p2p":
                    kind, pair, _, done = args
                    if (pair[0] if kind == "send" else pair[1]) == rank:
                        dones.append(done)
                        self.held.remove((what, args))
        self.close_connections(rank, "it closed its connections (aborted or closed)")
        return dones

    def close_connections(self, rank: int, why: str) -> None:
        """Rule 2: the peers' pending ops that wait on ``rank`` fail, now and later."""
        failed: list[Any] = []
        with self.world.lock:
            if rank in self.gone:
                return
            self.gone[rank] = why
            for index, meeting in list(self.meetings.items()):
                if rank not in meeting:
                    del self.meetings[index]
                    failed += [a.done for a in meeting.values()]
            for (source, destination), queue in list(self.channels.items()):
                if rank in (source, destination):
                    failed += [done for _, _, done in queue]
                    queue.clear()
        error = GangError(f"Connection closed by peer (rank {rank}: {why}).")
        for done in failed:
            self.world.schedule(functools.partial(done, error))

    def stall(self, rank: int) -> None:
        with self.world.lock:
            self.stalled.add(rank)

    def resume(self, rank: int) -> None:
        with self.world.lock:
            self.stalled.discard(rank)
            held, self.held = self.held, []
        for what, args in held:
            if what == "arrive":
                self.arrive(*args)
            else:
                self.point_to_point(*args)


@dataclass
class _Epoch:
    communicator: _Linked
    members: list[Member]
    came: set[int] = field(default_factory=set)


@final
class FakeEpochs:
    """A gang factory (``agang._membership.gangs``) over FakeWorld (module rules).

    Args:
        latency: Seconds each op takes to complete once every member issued it.
    """

    def __init__(self, latency: float = 0.0) -> None:
        self._simulation = Simulation(latency)
        self._changed = threading.Condition()
        self._epochs: dict[str, _Epoch] = {}
        self._dead: dict[str, str] = {}  # uid -> why (rule 3)
        self._stalled: set[str] = set()

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
    ) -> FakeWorldGang:
        with self._changed:
            epoch = self._epochs.get(prefix)
            if epoch is None:
                linked = _Linked(self._simulation, len(members))
                epoch = self._epochs[prefix] = _Epoch(linked, list(members))
            epoch.came.add(rank)
            self._changed.notify_all()
            everyone = set(range(len(members)))
            came = self._changed.wait_for(
                lambda: epoch.came == everyone or self._any_dead(epoch), timeout=timeout
            )
            dead = self._any_dead(epoch)
            if not came or dead:
                missing = sorted(everyone - epoch.came)
                why = dead or f"ranks {missing} did not come within {timeout:g} s"
                raise GangInitError(f"Epoch gang '{name}' could not be made: {why}.")
            for index, member in enumerate(epoch.members):
                if member.uid in self._stalled:
                    epoch.communicator.stall(index)
        policy = make_policy(
            op_timeout=math.inf if op_timeout is None else op_timeout,
            on_timeout="abort",
            check_order=False,
        )
        return FakeWorldGang(
            epoch.communicator, rank=rank, name=name, policy=policy, device=torch.device("cpu")
        )

    def _any_dead(self, epoch: _Epoch) -> str | None:
        dead = [f"'{m.name}' {self._dead[m.uid]}" for m in epoch.members if m.uid in self._dead]
        return "; ".join(dead) or None

    def rendezvous_keys(self, size: int) -> list[str]:
        return []

    def _of(self, uid: str) -> list[tuple[_Linked, int]]:
        with self._changed:
            return [
                (epoch.communicator, index)
                for epoch in self._epochs.values()
                for index, member in enumerate(epoch.members)
                if member.uid == uid
            ]

    def kill(self, uid: str, why: str = "killed") -> None:
        """The member ``uid`` dies: its connections close in every epoch (rule 3)."""
        with self._changed:
            self._dead[uid] = why
            self._changed.notify_all()
        for communicator, rank in self._of(uid):
            communicator.close_connections(rank, why)

    def stall(self, uid: str) -> None:
        """The member ``uid`` stops: its ops wait at their meetings (rule 3)."""
        with self._changed:
            self._stalled.add(uid)
        for communicator, rank in self._of(uid):
            communicator.stall(rank)

    def resume(self, uid: str) -> None:
        with self._changed:
            self._stalled.discard(uid)
        for communicator, rank in self._of(uid):
            communicator.resume(rank)
