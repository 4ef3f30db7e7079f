"""The simulated device of ``SimulatedNccl``: streams, events and the kernels of
collectives, for every simulated rank.

The rules it keeps, NCCL's and CUDA's:
1. A stream is a FIFO queue of kernels: a kernel runs only once every kernel queued
   before it on its stream has run. An event is recorded as a marker in the queue and is
   complete once the stream has passed it; an event never recorded is complete.
2. A collective's kernel runs only when every participating rank's kernel for it is at
   the head of its stream (NCCL's kernels block until all peers have joined), and never
   while one of those ranks is paused. It reads its inputs and writes its outputs *when
   it runs*: a read before the device got there sees the old data.
3. A failed collective (``fail_next``) and an aborted communicator's kernels exit without
   writing outputs, each when it reaches the head of its stream (a kernel cannot exit
   before it starts); their Work then holds the error. A c10d watchdog timeout fails every
   pending op of the communicator on that rank and aborts it there.
4. A stall (``Stall``, ``torch.cuda._sleep`` on a GPU) keeps its stream busy for its
   seconds from when it reaches the head of the stream, not from when it was queued:
   it stands in for a rank's own long kernel.
5. *The device runs a kernel as soon as it can, on the thread that made it runnable.* A
   GPU needs no CPU thread of the host to run its kernels, and on one rank a small op
   ends within microseconds of its issue. So what becomes runnable when work is queued
   (the last rank's part of a collective, an event behind finished work) runs there and
   then, on the queuing thread, under the device's lock; the device thread runs only
   what time or another thread releases (a stall that ends, a paused rank resumed, a
   watchdog timeout). Neither a raw caller nor agang pays a thread hop the GPU would not
   make them pay, so the simulation shows the host's own cost per op (its Python, its
   thread hand-offs) fairly. What it cannot show: a kernel's own time (the host thread
   that runs it is busy meanwhile, where a GPU would run it beside the host), and the
   driver's costs (launches, events, interrupts).
6. *Across processes* (``agang._backends.sim_nccl.wire``), a collective has parts in other
   processes, which this device cannot see. Its part, once at the head of its stream (and
   its rank not paused), is launched on the collective's wire, and holds its stream until
   the wire ends it (``complete``): rule 2's "every rank at the head" is then the wire's
   to wait for. An abort or the watchdog ends it as rule 3 says, whatever the wire does
   after; the wire then writes nothing.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from agang._runtime import fork, threads

log = logging.getLogger("agang.testing")

#: The longest the device thread sleeps: how late it may notice a c10d timeout.
WATCHDOG_TICK = 0.02


class SimStream:
    """A simulated stream of one rank (rule 1)."""

    def __init__(self, device: SimDevice, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.items: deque[Any] = deque()
        self._device = device

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, rank {self.rank})"


class SimEvent:
    """A simulated event (rule 1); ``synchronize`` blocks until the stream passed it."""

    def __init__(self, device: SimDevice) -> None:
        self._device = device
        self.done = True

    def record(self, stream: SimStream) -> None:
        with self._device.cond:
            self.done = False
            self._device.enqueue(stream, self)

    def synchronize(self) -> None:
        with self._device.cond:
            self._device.cond.wait_for(lambda: self.done or self._device.closed)
            if not self.done:
                raise RuntimeError("The simulated device was closed before the event completed.")

    def query(self) -> bool:
        return self.done


class HostFn:
    """Host code whose device work is ordered on a stream: runs when the stream gets there."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn


class WaitFor:
    """A kernel that holds its stream until ``marker`` (an event or a part) is done."""

    def __init__(self, marker: SimEvent | Part) -> None:
        self.marker = marker


class Stall:
    """A kernel that keeps its stream busy for ``seconds`` once it starts (rule 4)."""

    def __init__(self, device: SimDevice, seconds: float) -> None:
        self.seconds = seconds
        self.until: float | None = None  # set when it reaches the head of its stream
        self.ended_at: float | None = None
        self._device = device

    def wait(self, timeout: float | None = None) -> float | None:
        """Blocks until the device got past the stall, at most ``timeout`` seconds;
        returns that moment (``time.monotonic()``), or None if it has not yet."""
        with self._device.cond:
            self._device.cond.wait_for(
                lambda: self.ended_at is not None or self._device.closed, timeout
            )
            return self.ended_at


class Part:
    """One rank's kernel of a collective. ``done`` once it has run or exited."""

    def __init__(self, collective: Collective, rank: int, inputs: Any, outputs: Any) -> None:
        self.collective = collective
        self.rank = rank
        self.inputs = inputs
        self.outputs = outputs
        self.done = False
        self.error: BaseException | None = None
        self.at_head = False
        self.issued_at = time.monotonic()
        self.timeout: float | None = None
        self.communicator: Any = None  # the rank's group, for the watchdog
        self.index = 0  # its op's place among its communicator's ops of its kind
        self.launched = False  # handed to the wire (rule 6)


class Collective:
    """One op of a communicator, joined by each participant's ``Part``."""

    def __init__(
        self,
        kind: str,
        ranks: list[int],
        run: Callable[[dict[int, Part]], None],
        *,
        options: Any = None,
        wire: Wire | None = None,
    ):
        self.kind = kind
        self.ranks = ranks
        self.run = run
        self.options = options
        self.wire = wire  # set where its other ranks' parts are in other processes
        self.parts: dict[int, Part] = {}


class Wire(Protocol):
    """What carries a collective to the ranks of other processes (rule 6)."""

    def launch(self, stream: SimStream, part: Part, failure: str | None) -> None:
        """Runs ``part`` with its peers' parts, then ends it (``SimDevice.complete``);
        ``failure``: a message that fails the op on every rank instead."""

    def abort(self) -> None:
        """Closes the wire: what it runs for this rank ends without writing."""


_devices: weakref.WeakSet[SimDevice] = weakref.WeakSet()


def _close_all() -> None:
    for device in list(_devices):
        device.close()


def _forget_in_child() -> None:
    # The devices' threads are the parent's (``agang._runtime.fork``): the child closes none.
    global _devices
    _devices = weakref.WeakSet()


threads.at_exit(stop=_close_all)
fork.on_fork_in_child(_forget_in_child)


class SimDevice:
    """Every simulated rank's streams, run by one device thread (rules 1 to 3)."""

    def __init__(self, *, watchdog_timeout: float | None) -> None:
        lock = threading.RLock()
        #: Host threads wait on it (an event synchronized, an abort), woken by any change.
        self.cond = threading.Condition(lock)
        # The device thread waits on its own condition of the same lock, woken only for
        # what needs its timing (a stall starting, closing): waking it at every queued
        # kernel would pass the GIL to it and back for nothing (rule 5).
        self._timing = threading.Condition(lock)
        self.closed = False
        self.streams: list[SimStream] = []
        self.paused: set[int] = set()
        self.watchdog_timeout = watchdog_timeout
        self._failures: deque[str] = deque()
        self._pending: list[Part] = []
        self._wake_at: float | None = None  # when the next running stall ends
        self._stepping = False  # a thread is advancing the streams (rule 5)
        _devices.add(self)
        threads.start_daemon(self._run, name="agang-sim-nccl-device")

    # Called with ``cond`` held or taking it.

    def new_stream(self, rank: int, name: str) -> SimStream:
        stream = SimStream(self, rank, name)
        with self.cond:
            self.streams.append(stream)
        return stream

    def enqueue(self, stream: SimStream, item: Any) -> None:
        with self.cond:
            stream.items.append(item)
            if isinstance(item, Part):
                self._pending.append(item)
            self.run_what_can_run()

    def run_what_can_run(self) -> None:
        """Runs every kernel that can run now, on this thread (rule 5); wakes whoever
        waits on the device. The caller holds ``cond``."""
        if self._stepping:  # queued by a host function the device is running
            self.cond.notify_all()
            return
        self._stepping = True
        try:
            while self._step():
                pass
        finally:
            self._stepping = False
        self.cond.notify_all()

    def pause(self, rank: int) -> None:
        with self.cond:
            self.paused.add(rank)

    def resume(self, rank: int) -> None:
        with self.cond:
            self.paused.discard(rank)
            self.run_what_can_run()

    def fail_next(self, message: str) -> None:
        with self.cond:
            self._failures.append(message)

    def fail(self, part: Part, error: BaseException) -> None:
        """Makes ``part``'s kernel exit with ``error`` (it leaves its stream when at head)."""
        with self.cond:
            if not part.done and part.error is None:
                part.error = error
                self.run_what_can_run()

    def stall(self, stream: SimStream, seconds: float) -> Stall:
        """Queues a kernel keeping ``stream`` busy for ``seconds`` once it starts."""
        stall = Stall(self, seconds)
        self.enqueue(stream, stall)
        return stall

    def hold(self, stream: SimStream) -> Callable[[], None]:
        """Holds ``stream`` at its current end until the returned function is called."""
        gate = SimEvent(self)
        gate.done = False
        self.enqueue(stream, WaitFor(gate))

        def release() -> None:
            with self.cond:
                gate.done = True
                self.run_what_can_run()

        return release

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            self._timing.notify_all()

    # The device thread.

    def _run(self) -> None:
        with self.cond:
            while not self.closed:
                self._stepping = True
                try:
                    progress = self._step()
                finally:
                    self._stepping = False
                if progress:
                    self.cond.notify_all()
                    continue
                wait = self._watchdog()
                if self._wake_at is not None:
                    left = max(self._wake_at - time.monotonic(), 0.0)
                    wait = left if wait is None else min(wait, left)
                # A part queued since is seen within WATCHDOG_TICK, its timeout in time.
                self._timing.wait(WATCHDOG_TICK if wait is None else min(wait, WATCHDOG_TICK))

    def _watchdog(self) -> float | None:
        """Fails the ops past their c10d timeout (rule 3); the wait until the next one."""
        now = time.monotonic()
        self._pending = [p for p in self._pending if not p.done and p.error is None]
        wait: float | None = None
        for part in self._pending:
            timeout = self.watchdog_timeout if self.watchdog_timeout is not None else part.timeout
            if timeout is None:
                continue
            left = part.issued_at + timeout - now
            if left <= 0 and part.communicator is not None:
                part.communicator.watchdog_fired(timeout)
                return 0.0
            wait = left if wait is None else min(wait, left)
        return wait

    def _step(self) -> bool:
        progress = False
        self._wake_at = None
        for stream in self.streams:
            while stream.items and stream.rank not in self.paused:
                if not self._advance(stream, stream.items[0]):
                    break
                progress = True
        return progress

    def _advance(self, stream: SimStream, item: Any) -> bool:
        """Runs ``item``, the head of ``stream``, if it can run now."""
        if isinstance(item, SimEvent):
            item.done = True
        elif isinstance(item, WaitFor):
            if not item.marker.done:
                return False
        elif isinstance(item, Stall):
            now = time.monotonic()
            if item.until is None:
                item.until = now + item.seconds
                self._timing.notify_all()  # the device thread ends it on time
            if now < item.until:
                self._wake_at = (
                    item.until if self._wake_at is None else min(self._wake_at, item.until)
                )
                return False
            item.ended_at = now
        elif isinstance(item, HostFn):
            try:
                item.fn()
            except Exception:
                log.exception("Host work queued on simulated stream %r failed.", stream.name)
        elif isinstance(item, Part):
            return self._advance_part(stream, item)
        stream.items.popleft()
        return True

    def _advance_part(self, stream: SimStream, part: Part) -> bool:
        part.at_head = True
        if part.error is not None:  # failed or aborted: the kernel exits
            part.done = True
            self._pop(part)
            return True
        collective = part.collective
        if collective.wire is not None:  # rule 6: it holds its stream until the wire ends it
            if not part.launched:
                part.launched = True
                failure = self._failures.popleft() if self._failures else None
                collective.wire.launch(stream, part, failure)
            return False
        parts = collective.parts
        ready = len(parts) == len(collective.ranks) and all(
            p.at_head and p.error is None and p.rank not in self.paused for p in parts.values()
        )
        if not ready:
            return False
        if self._failures:
            message = self._failures.popleft()
            for p in parts.values():
                p.error = p.communicator.async_error(message)
        else:
            try:
                with torch.no_grad():  # results go into tensors that may require grad
                    collective.run(parts)
            except Exception as exc:
                for p in parts.values():
                    p.error = exc
        for p in parts.values():
            p.done = True
            self._pop(p)
        return True

    def complete(
        self, part: Part, run: Callable[[], None] | None, error: BaseException | None
    ) -> None:
        """Ends ``part``, which the wire ran (rule 6): ``run`` writes its outputs, or
        ``error`` fails it. Nothing is written where an abort or the watchdog ended the
        part first (its kernel has exited)."""
        with self.cond:
            if part.done or part.error is not None:
                return
            if error is None and run is not None:
                try:
                    with torch.no_grad():
                        run()
                except Exception as exc:
                    error = exc
            part.error = error
            part.done = True
            self._pop(part)
            self.run_what_can_run()

    def _pop(self, part: Part) -> None:
        for stream in self.streams:
            if stream.items and stream.items[0] is part:
                stream.items.popleft()
                return
