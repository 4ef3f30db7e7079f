"""The backend of ``FakeWorld``: n ranks in one event loop, with real semantics.

It implements the contract of ``agang._backends.contract``; ``FakeWorldGang`` is the
gang over it.

Rules:
1. Each member of a communicator counts its collectives; the k-th collective of every
   member meets the k-th of the others (as in c10d). When the last one arrives the op is
   computed from all inputs and every member's op completes.
2. Members that disagree (another op, root, reduce op, dtype or shape, or, for uneven
   all_to_all, the rows between two of them) all fail with a ``GangError`` naming each
   rank's side, where real c10d would hang, corrupt data or end the process.
3. Point-to-point ops (send, recv, each transfer of an exchange) match per (source,
   destination) pair in FIFO order, apart from the collectives' count, as in c10d.
4. Completions are never run inline on the issuing call: they are scheduled on the loop
   (asyncio ``call_soon``, trio ``run_sync_soon``) or, with ``latency``, after that many
   seconds. So awaiting, cancellation and deadlines behave as with a real backend.
5. Making a child (a sub-gang or a lane) is a meeting of its own, counted apart from
   the collectives, as in c10d: it takes no collective's place and no sequence number.
   Members that disagree on the child's ranks all fail.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, final

import anyio
import torch

from agang._backends.contract import (
    Blamed,
    Checked,
    Done,
    Explanation,
    Progress,
    ProgressOf,
    after_post,
    countdown,
)
from agang._backends.cuda.runtime import StreamOrder
from agang._backends.fingerprint import agree
from agang._engine import deadlines
from agang._errors import GangError, GangInitError
from agang._reduce_op import ReduceOp
from agang._runtime import loops
from agang._runtime.future import Future, finish
from agang.testing._world.compute import COMPUTE, Arrival


class Simulation:
    """What every communicator of one world shares: a lock, and how completions run.

    Args:
        latency: Seconds each op takes to complete once every rank has issued it.
    """

    def __init__(self, latency: float) -> None:
        self.lock = threading.RLock()
        self.latency = latency

    def schedule(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` soon on this thread's loop, never inline (rule 4)."""
        if self.latency:
            driver = deadlines.current_driver()
            deadlines.call_at(driver, time.monotonic() + self.latency, callback)
            return
        if not loops.call_soon(callback):
            callback()  # no loop here: synchronous callers see it done at once


def _settle(future: Future[Any], value: Any, error: BaseException | None) -> None:
    finish(future, value, error)


@dataclass
class _Creation:
    rank: int
    members: tuple[int, ...]
    name: str
    device: torch.device
    made: Future[FakeWorldBackend | None]


@dataclass
class Communicator:
    """The ranks of one simulated communicator, and the ops they are meeting at."""

    world: Simulation
    size: int
    meetings: dict[int, dict[int, Arrival]] = field(default_factory=dict)
    checks: dict[int, dict[int, tuple[str, Checked]]] = field(default_factory=dict)
    # How each rank's engine says where it stands (blame), once it served it.
    progress: dict[int, ProgressOf] = field(default_factory=dict)
    channels: dict[tuple[int, int], deque[tuple[str, torch.Tensor, Done]]] = field(
        default_factory=dict
    )
    creations: dict[int, dict[int, _Creation]] = field(default_factory=dict)

    def arrive(self, index: int, arrival: Arrival) -> None:
        with self.world.lock:
            meeting = self.meetings.setdefault(index, {})
            meeting[arrival.rank] = arrival
            if len(meeting) < self.size:
                return
            del self.meetings[index]
        self._settle([meeting[r] for r in range(self.size)])

    def _settle(self, arrivals: list[Arrival]) -> None:
        first = arrivals[0]
        if any((a.kind, a.key) != (first.kind, first.key) for a in arrivals):
            sides = "; ".join(f"rank {a.rank}: {a.kind} {a.key}" for a in arrivals)
            error = GangError(f"The ranks issued different collectives at one position: {sides}")
            self._finish_all(arrivals, error)
            return
        try:
            with torch.no_grad():  # results go into tensors that may require grad
                COMPUTE[first.kind](arrivals)
        except Exception as exc:
            self._finish_all(arrivals, exc)
            return
        self._finish_all(arrivals, None)

    def check(self, index: int, rank: int, fingerprint: str, checked: Checked) -> None:
        """Order checking: the ``index``-th fingerprints of every member meet here."""
        with self.world.lock:
            meeting = self.checks.setdefault(index, {})
            meeting[rank] = (fingerprint, checked)
            if len(meeting) < self.size:
                return
            del self.checks[index]
        fingerprints = {r: fp for r, (fp, _) in meeting.items()}
        agreed = agree(fingerprints)
        for _, report in meeting.values():
            self.world.schedule(functools.partial(report, None if agreed else fingerprints, None))

    def blame(self, rank: int, number: int, collective: bool) -> dict[int, Progress | None]:
        """Every other rank's answer about op ``number`` (a sequence number, or with
        ``collective`` a number among collectives), asked directly (rank's own lock
        only: no rank's lock is held while another's is taken)."""
        with self.world.lock:
            asked = {r: self.progress.get(r) for r in range(self.size) if r != rank}
        return {
            r: None if progress is None else progress(number, collective)
            for r, progress in asked.items()
        }

    def withdraw(self, rank: int) -> list[Done]:
        """Takes back ``rank``'s ops that no peer has met yet; returns their ``done``."""
        with self.world.lock:
            dones = [
                meeting.pop(rank).done for meeting in self.meetings.values() if rank in meeting
            ]
            for meeting in self.checks.values():
                if rank in meeting:
                    report = meeting.pop(rank)[1]
                    dones.append(functools.partial(report, None))
            for (source, destination), queue in list(self.channels.items()):
                mine = "send" if source == rank else "recv" if destination == rank else None
                dones += [done for kind, _, done in queue if kind == mine]
                self.channels[source, destination] = deque(e for e in queue if e[0] != mine)
        return dones

    def create(self, index: int, creation: _Creation) -> None:
        """The ``index``-th child creation of every rank meets here (rule 5)."""
        with self.world.lock:
            meeting = self.creations.setdefault(index, {})
            meeting[creation.rank] = creation
            if len(meeting) < self.size:
                return
            del self.creations[index]
        arrivals = [meeting[r] for r in range(self.size)]
        first = arrivals[0]
        if any(a.members != first.members for a in arrivals):
            sides = "; ".join(f"rank {a.rank}: ranks {list(a.members)}" for a in arrivals)
            error = GangInitError(f"The ranks asked for different gangs at one position: {sides}")
        elif any(a.name != first.name for a in arrivals):  # c10d's children: its rule 5
            said = "; ".join(f"rank {a.rank}: '{a.name}'" for a in arrivals)
            error = GangInitError(
                f"Creating gang '{first.name}' failed: it was made by one call with other "
                f"gangs on other ranks ({said}); make lanes and sub-gangs in the same order "
                f"on every rank."
            )
        else:
            error = None
        if error is not None:
            for a in arrivals:
                self.world.schedule(functools.partial(_settle, a.made, None, error))
            return
        child = Communicator(self.world, len(first.members))
        for a in arrivals:
            backend = None
            if a.rank in first.members:
                rank = first.members.index(a.rank)
                backend = FakeWorldBackend(child, rank=rank, name=a.name, device=a.device)
            self.world.schedule(functools.partial(_settle, a.made, backend, None))

    def _finish_all(self, arrivals: list[Arrival], error: BaseException | None) -> None:
        for arrival in arrivals:
            self.world.schedule(functools.partial(arrival.done, error))

    def point_to_point(
        self, kind: str, pair: tuple[int, int], tensor: torch.Tensor, done: Done
    ) -> None:
        with self.world.lock:
            queue = self.channels.setdefault(pair, deque())
            if queue and queue[0][0] != kind:
                _, other, other_done = queue.popleft()
            else:
                queue.append((kind, tensor, done))
                return
        sent, received = (tensor, other) if kind == "send" else (other, tensor)
        if sent.shape != received.shape or sent.dtype != received.dtype:
            error = GangError(
                f"send of {tuple(sent.shape)} {sent.dtype} met recv of "
                f"{tuple(received.shape)} {received.dtype} between ranks {pair}"
            )
            self.world.schedule(lambda: done(error))
            self.world.schedule(lambda: other_done(error))
            return
        with torch.no_grad():
            received.copy_(sent)
        self.world.schedule(lambda: done(None))
        self.world.schedule(lambda: other_done(None))


def _shapes(*tensors: torch.Tensor) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@final
class FakeWorldBackend:
    """One rank of a simulated communicator."""

    def __init__(
        self, communicator: Communicator, *, rank: int, name: str, device: torch.device
    ) -> None:
        self.communicator = communicator
        self._rank = rank
        self._name = name
        self._device = device
        self._num_collectives = 0
        self._num_creations = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.communicator.size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kind(self) -> str:
        return "fake"

    @property
    def name(self) -> str:
        return self._name

    def _arrive(self, kind: str, key: tuple[Any, ...], args: tuple[Any, ...], done: Done) -> None:
        index = self._num_collectives
        self._num_collectives += 1
        self.communicator.arrive(index, Arrival(self._rank, kind, key, args, done))

    def start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        done = after_post(post, done)
        self._arrive("all_reduce", (op, *_shapes(tensor)), (tensor,), done)

    def start_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, done: Done, *, to_host: bool = False
    ) -> None:
        self._arrive("all_gather", _shapes(output, input), (output, input), done)

    def start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        self._arrive("all_gather_to_list", _shapes(input), (outputs, input), done)

    def start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        self._arrive("reduce_scatter", (op, *_shapes(output, input)), (output, input), done)

    def start_broadcast(
        self, tensor: torch.Tensor, source_rank: int, done: Done, *, to_host: bool = False
    ) -> None:
        self._arrive("broadcast", (source_rank, *_shapes(tensor)), (tensor,), done)

    def start_all_gather_uneven(
        self, output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], done: Done
    ) -> None:
        key = (tuple(split_sizes), tuple(input.shape[1:]), input.dtype)
        self._arrive("all_gather_uneven", key, (output, input), done)

    def start_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        done: Done,
        *,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        if output_split_sizes is None or input_split_sizes is None:
            self._arrive("all_to_all", _shapes(output, input), (output, input), done)
            return
        # The sizes differ by rank: only the rows' shape and dtype must agree here.
        key = ("split", tuple(input.shape[1:]), input.dtype)
        args = (output, input, output_split_sizes, input_split_sizes)
        self._arrive("all_to_all", key, args, done)

    # The rooted collectives. Only the root holds its blocks, so the ranks agree on the
    # root and on the shape of the tensor every rank has; off the destination a reduce
    # leaves ``tensor`` as it is.

    def start_reduce(
        self, tensor: torch.Tensor, destination_rank: int, op: ReduceOp, done: Done
    ) -> None:
        self._arrive("reduce", (op, destination_rank, *_shapes(tensor)), (tensor,), done)

    def start_gather(
        self,
        outputs: list[torch.Tensor] | None,
        input: torch.Tensor,
        destination_rank: int,
        done: Done,
    ) -> None:
        self._arrive("gather", (destination_rank, *_shapes(input)), (outputs, input), done)

    def start_scatter(
        self,
        output: torch.Tensor,
        inputs: list[torch.Tensor] | None,
        source_rank: int,
        done: Done,
    ) -> None:
        self._arrive("scatter", (source_rank, *_shapes(output)), (output, inputs), done)

    def start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        self.communicator.point_to_point("send", (self._rank, destination_rank), tensor, done)

    def start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        self.communicator.point_to_point("recv", (source_rank, self._rank), tensor, done)

    def start_exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        done: Done,
    ) -> None:
        each = countdown(len(sends) + len(recvs), done)
        for tensor, destination in sends:
            self.communicator.point_to_point("send", (self._rank, destination), tensor, each)
        for tensor, source in recvs:
            self.communicator.point_to_point("recv", (source, self._rank), tensor, each)

    def start_barrier(self, done: Done) -> None:
        self._arrive("barrier", (), (), done)

    def start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        self.communicator.check(index, self._rank, fingerprint, checked)

    def serve_progress(self, progress: ProgressOf) -> None:
        with self.communicator.world.lock:
            self.communicator.progress[self._rank] = progress

    def start_blame(self, number: int, report: Blamed, *, collective: bool = False) -> None:
        report(self.communicator.blame(self._rank, number, collective), "")

    def where(self, rank: int) -> str:
        return f"rank {rank}"

    def explain(self, error: BaseException) -> Explanation:
        return Explanation()

    polls = False  # every op reports its own end

    def poll(self) -> None:
        pass

    def park(self, issued_before: float = math.inf) -> float | None:
        return None

    def defer(self, start: Callable[[], None]) -> Callable[[], None]:
        return start

    def stream_order(self) -> StreamOrder | None:
        return None

    def allow_timeout(self, seconds: float | None) -> None:
        pass

    def _withdraw(self, reason: str) -> None:
        # As aborting a real communicator ends its unfinished work: the ops' tensors are
        # released, instead of staying busy (keyed by address) after they are freed.
        error = GangError(
            f"Gang '{self._name}' (rank {self._rank}) was {reason} before its peers came."
        )
        for done in self.communicator.withdraw(self._rank):
            done(error)

    def abort(self, reason: str | None = None) -> None:
        self._withdraw("aborted")

    def release(self, *, unfinished: bool) -> None:
        self._withdraw("closed")

    async def create_child(
        self, members: list[int], *, name: str, high_priority: bool, seconds: float | None
    ) -> FakeWorldBackend | None:
        index = self._num_creations
        self._num_creations += 1
        made: Future[FakeWorldBackend | None] = Future(f"create gang {members}")
        creation = _Creation(self._rank, tuple(members), name, self._device, made)
        self.communicator.create(index, creation)
        with anyio.move_on_after(seconds):
            return await made
        raise GangInitError(
            f"Creating a gang of ranks {members} did not finish within {seconds} s; every "
            f"rank must call create_gang (or lane) with the same ranks, in the same order."
        )
