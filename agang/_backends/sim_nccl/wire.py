"""``GlooWire``: what carries a simulated NCCL communicator's ops between processes.

The simulated device (``device``) runs a kernel once every rank's part is at the head
of its stream; across processes it cannot see the other ranks' parts, so it hands its
own to the communicator's wire (``device`` rule 6), which keeps NCCL's rules:
1. One wire per communicator: a Gloo group of its own, made from the communicator's
   store under the prefix ``wire``, registered nowhere. Gloo carries bytes; what a kernel
   computes is still ``kernels``', so the results equal ``SimulatedNccl``'s and
   ``FakeWorld``'s bit for bit.
2. A lane per stream: the parts launched from one stream run in launch order on one
   thread, each to its end before the next (a stream's kernels run one at a time), and
   parts of different streams (a coalescing group's transfers, one stream per pair) wait
   for their peers independently, as NCCL's do.
3. A collective is two Gloo all-gathers: each rank's description and byte lengths, then
   its description and input bytes, padded to the longest. Every rank then runs the kernel
   over every rank's inputs, decoded from the same bytes in rank order (its own too),
   into its own outputs; the other ranks' outputs are scratch. So all ranks compute the
   same result, and a mismatch (another kind, op or root, a peer failing the op) is seen
   by every rank alike and fails the op on each with the same error.
4. A send or receive is a rendezvous, as NCCL's: the sender sends a header (the byte
   count and the transfer's place in its pair's order), the receiver answers it once its
   own part runs (accepting only the byte count it expects), and only then do the bytes
   move. Two ranks that both send first wait for each other, as on NCCL; a byte count
   that disagrees fails the transfer on both ranks, where a Gloo receive of the wrong
   size would end the receiving process. Tags: ``3 * index + step``, the index counted
   per (source, destination), far below the tags agang's Gloo abort uses.
5. Pending until abort: a Gloo op that fails (a peer died, or closed its connections in
   its own abort) stops its lane. Its part, and the ones queued behind it, stay pending
   and write nothing, as NCCL's kernels wait for a peer that never comes; what ends them
   is this rank's abort or its watchdog (``device`` rule 3), which then closes the wire
   (``abort``): its connections close, its lanes' waits fail and the lanes end.
6. Gloo's own timeout is the communicator's set-up deadline while the wire connects (a
   missing member fails the set-up, as an eagerly connected NCCL communicator does), then
   a day: a Gloo wait that times out closes every connection of its group, which NCCL
   never does on its own.
"""

from __future__ import annotations

import logging
import pickle
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.c10d.abort import abort_group
from agang._backends.c10d.calls import all_gather_flat
from agang._backends.sim_nccl.device import Part, SimDevice, SimStream
from agang._backends.sim_nccl.payload import Layout, decode, encode, scratch
from agang._runtime import fork, threads

log = logging.getLogger("agang.testing")

#: Gloo's own timeout on a wire (rule 6).
GLOO_TIMEOUT = timedelta(days=1)


class _Lost(Exception):
    """A Gloo op of the wire failed: the lane stops (rule 5)."""


@dataclass
class _Description:
    """One rank's account of a collective (rule 3)."""

    kind: str
    index: int
    op: str | None
    root: int | None
    inputs: Layout
    outputs: Layout
    failure: str | None
    #: Why this rank could not give its part (its inputs did not encode): every rank
    #: fails the op with it, and the wire stays in step.
    error: str | None = None


class _Lane:
    """The parts launched from one stream, run in order on one thread (rule 2)."""

    def __init__(self, wire: GlooWire, stream: SimStream) -> None:
        self.queue: deque[tuple[Part, str | None]] = deque()
        self.cond = threading.Condition()
        self._wire = wire
        threads.start_daemon(self._run, name=f"agang-sim-nccl-wire {stream.name}")

    def _run(self) -> None:
        wire = self._wire
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue or wire.closed)
                if wire.closed:
                    return
                part, failure = self.queue.popleft()
            try:
                wire.run(part, failure)
            except _Lost as lost:
                if not wire.closed:
                    log.debug("Simulated NCCL wire '%s': a lane stopped: %s", wire.name, lost)
                return
            except Exception as error:  # a bug of ours: the op fails rather than hangs
                log.exception("Simulated NCCL wire '%s' failed to run a kernel.", wire.name)
                wire.device.complete(part, None, error)


_wires: weakref.WeakSet[GlooWire] = weakref.WeakSet()


def _abort_all() -> None:
    for wire in list(_wires):
        wire.abort()


def _forget_in_child() -> None:
    global _wires
    _wires = weakref.WeakSet()


threads.at_exit(stop=_abort_all)
fork.on_fork_in_child(_forget_in_child)


class GlooWire:
    """The wire of one simulated communicator (module rules).

    Args:
        store: The communicator's store; the wire's Gloo group is made under ``wire``.
        rank: This rank in the communicator.
        size: The communicator's size.
        device: This process's simulated device.
        name: The communicator's name, for messages.
        connect_timeout: How long making it waits for every rank (rule 6).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        device: SimDevice,
        name: str,
        connect_timeout: timedelta = GLOO_TIMEOUT,
    ) -> None:
        self.device = device
        self.name = name
        self.rank = rank
        self.size = size
        self.closed = False
        prefixed = dist.PrefixStore("wire", store)  # type: ignore[attr-defined]
        self._gloo: Any = dist.ProcessGroupGloo(prefixed, rank, size, connect_timeout)
        self._gloo.set_timeout(GLOO_TIMEOUT)  # rule 6: connected
        self._lanes: dict[SimStream, _Lane] = {}
        self._abort_lock = threading.Lock()
        _wires.add(self)

    def launch(self, stream: SimStream, part: Part, failure: str | None) -> None:
        """Queues ``part`` on ``stream``'s lane (``device`` rule 6); never blocks."""
        lane = self._lanes.get(stream)
        if lane is None:
            lane = self._lanes[stream] = _Lane(self, stream)
        with lane.cond:
            lane.queue.append((part, failure))
            lane.cond.notify()

    def abort(self) -> None:
        """Closes the wire (rule 5): its connections close, its lanes end. Idempotent;
        never raises."""
        with self._abort_lock:
            if self.closed:
                return
            self.closed = True
            for lane in list(self._lanes.values()):
                with lane.cond:
                    lane.cond.notify()
            if self.size > 1:
                abort_group(self._gloo, "gloo")

    # Running one part, on its lane's thread.

    def run(self, part: Part, failure: str | None) -> None:
        if part.collective.kind == "send":
            self._transfer(part)
        else:
            self._collective(part, failure)

    def _collective(self, part: Part, failure: str | None) -> None:
        """Rule 3."""
        collective = part.collective
        options = collective.options
        op = getattr(options, "reduceOp", None)
        mine = _Description(
            kind=collective.kind,
            index=part.index,
            op=None if op is None else str(getattr(op, "op", op)),
            root=getattr(options, "rootRank", None),
            inputs=Layout.of(part.inputs),
            outputs=Layout.of(part.outputs),
            failure=failure,
        )
        try:
            data = encode(part.inputs)
        except Exception as unreadable:  # its part fails on every rank, the wire in step
            mine.inputs = Layout.of(None)
            mine.error = f"rank {self.rank}'s inputs could not be read: {unreadable}"
            data = encode(None)
        header = pickle.dumps(mine)
        lengths = torch.zeros(2 * self.size, dtype=torch.int64)
        self._wait(all_gather_flat(self._gloo, lengths, torch.tensor([len(header), data.numel()])))
        longest = int((lengths[0::2] + lengths[1::2]).max())
        message = torch.zeros(longest, dtype=torch.uint8)
        message[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        message[len(header) : len(header) + data.numel()] = data
        everyone = torch.empty(longest * self.size, dtype=torch.uint8)
        self._wait(all_gather_flat(self._gloo, everyone, message))
        descriptions, inputs = [], []
        for rank in range(self.size):
            start = rank * longest
            header_length, data_length = (int(n) for n in lengths[2 * rank : 2 * rank + 2])
            description: _Description = pickle.loads(
                everyone[start : start + header_length].numpy().tobytes()
            )
            body = everyone[start + header_length : start + header_length + data_length]
            descriptions.append(description)
            inputs.append(decode(description.inputs, body))
        error = self._disagreement(descriptions, part)
        if error is not None:
            self.device.complete(part, None, error)
            return
        parts = {
            rank: Part(
                collective,
                rank,
                inputs[rank],
                part.outputs if rank == self.rank else scratch(descriptions[rank].outputs),
            )
            for rank in range(self.size)
        }
        self.device.complete(part, lambda: collective.run(parts), None)

    def _disagreement(self, descriptions: list[_Description], part: Part) -> BaseException | None:
        """The error every rank fails the op with where the ranks' accounts disagree
        (rule 3), or None."""
        first = descriptions[0]
        for description in descriptions:
            if description.error is not None:
                return RuntimeError(f"Simulated NCCL: on '{self.name}', {description.error}.")
        for rank, description in enumerate(descriptions):
            if description.failure is not None:
                return part.communicator.async_error(description.failure)  # type: ignore[no-any-return]
            if (description.kind, description.index) != (first.kind, first.index):
                return RuntimeError(
                    f"Simulated NCCL: on '{self.name}', rank {rank} ran {description.kind} "
                    f"#{description.index} where rank 0 ran {first.kind} #{first.index}."
                )
            if (description.op, description.root) != (first.op, first.root):
                return RuntimeError(
                    f"Simulated NCCL: on '{self.name}', rank {rank} ran {first.kind} with "
                    f"op {description.op} and root {description.root} where rank 0 has op "
                    f"{first.op} and root {first.root}."
                )
        return None

    def _transfer(self, part: Part) -> None:
        """Rule 4."""
        peer = _other(part, self.rank)
        tag = 3 * part.index
        if part.inputs is not None:  # the sender
            try:
                data = encode(part.inputs)
            except Exception as unreadable:  # the receiver is told (a count of -1); both fail
                self._wait(self._gloo.send([torch.tensor([-1, part.index])], peer, tag))
                reason = (
                    f"Simulated NCCL: rank {self.rank} could not read what it sends: {unreadable}"
                )
                self.device.complete(part, None, RuntimeError(reason))
                return
            header = torch.tensor([data.numel(), part.index])
            self._wait(self._gloo.send([header], peer, tag))
            answer = torch.zeros(1, dtype=torch.int64)
            self._wait(self._gloo.recv([answer], peer, tag + 1))
            expected = int(answer)
            if expected != data.numel():
                mismatch = _size_error(self.rank, peer, data.numel(), expected)
                self.device.complete(part, None, mismatch)
                return
            self._wait(self._gloo.send([data], peer, tag + 2))
            self.device.complete(part, None, None)
            return
        layout = Layout.of(part.outputs)
        header = torch.zeros(2, dtype=torch.int64)
        self._wait(self._gloo.recv([header], peer, tag))
        sent, index = (int(n) for n in header)
        if sent < 0 or index != part.index:  # the sender failed (and waits for no answer)
            why = "could not read what it sends" if sent < 0 else f"sent transfer #{index}"
            reason = f"Simulated NCCL: rank {peer} {why}, to this rank's #{part.index}"
            self.device.complete(part, None, RuntimeError(reason))
            return
        self._wait(self._gloo.send([torch.tensor([layout.nbytes])], peer, tag + 1))
        if sent != layout.nbytes:
            self.device.complete(part, None, _size_error(peer, self.rank, sent, layout.nbytes))
            return
        body = torch.empty(sent, dtype=torch.uint8)
        self._wait(self._gloo.recv([body], peer, tag + 2))

        def write() -> None:
            received = layout.tensors(decode(layout, body))
            for out, value in zip(layout.tensors(part.outputs), received, strict=True):
                out.copy_(value)

        self.device.complete(part, write, None)

    def _wait(self, work: Any) -> None:
        if self.closed:
            raise _Lost("the wire was closed")
        try:
            work.wait(GLOO_TIMEOUT)
        except Exception as error:
            raise _Lost(str(error)) from error


def _other(part: Part, rank: int) -> int:
    ranks = part.collective.ranks
    return ranks[1] if ranks[0] == rank else ranks[0]


def _size_error(source: int, destination: int, sent: int, expected: int) -> RuntimeError:
    return RuntimeError(
        f"Simulated NCCL: rank {source} sent {sent} bytes to rank {destination}, which "
        f"receives {expected} bytes: the sizes of a send and its receive must match."
    )
