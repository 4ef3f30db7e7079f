"""What every gang shares: checking input, numbering, deadlines, breaking and closing.

Rules (each implementation only says how to *start* a primitive op):
1. A call checks its input first; a bad call changes nothing, not even the sequence
   number, so ranks stay in step after a caught ``ValueError``.
2. Then it takes a sequence number and marks its tensors busy, atomically, and the op is
   started in call order. A two-phase op (the object collectives: sizes, then bytes)
   holds the *issue gate* between its phases: later ops wait in a queue and are started,
   in order, right after its second phase. Issue order is thus program order on every
   rank, whatever the timing.
3. A primitive reports its end once through ``done(error)`` from any thread. Its tensors
   are released then, and only then (c10d may still be writing into them until then).
4. A deadline is checked on the loop (or timer thread) of the issuer; when it passes,
   the handle fails with ``GangTimeoutError`` and the gang breaks.
5. Any failure of a started op breaks the gang: every pending handle fails with
   ``GangBrokenError`` (the first cause attached), the communicator is aborted, and every
   later call raises at once without touching c10d.
6. Closing fails pending handles with ``GangClosedError`` at once, then releases the
   backend off the loop.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from typing_extensions import override

from agang import _busy, _deadline, _objects
from agang._errors import (
    CollectiveError,
    GangBrokenError,
    GangClosedError,
    GangTimeoutError,
    OpContext,
)
from agang._gang import Gang
from agang._handle import Handle
from agang._reduce_op import ReduceOp
from agang._statistics import Counters, GangStatistics
from agang._validate import (
    check_rank,
    check_reduce_dtype,
    check_reduce_op,
    check_same_dtype,
    check_shape,
    check_tensor,
    check_tensor_list,
    check_timeout,
)

log = logging.getLogger("agang")

T = TypeVar("T")
Done = Callable[[BaseException | None], None]
Start = Callable[[Done], None]

_HISTORY = 16


class BaseGang(Gang):
    """Implements the public collectives on top of a few primitives (``_start_*``)."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        device: torch.device,
        backend: str,
        name: str,
        op_timeout: float | None,
    ) -> None:
        self._rank = rank
        self._size = size
        self._device = device
        self._backend = backend
        self._name = name
        self._op_timeout = op_timeout
        self._closed = False
        self._broken: BaseException | None = None
        self._lock = threading.RLock()
        self._next_seq = 0
        self._in_flight: dict[int, Handle[Any]] = {}
        self._bytes_in_flight = 0
        self._gate_held = False
        self._deferred: collections.deque[Callable[[], None]] = collections.deque()
        self._armed_at: float | None = None
        self._armed_driver: object = None
        self._counters = Counters()
        self._recent: collections.deque[Handle[Any]] = collections.deque(maxlen=_HISTORY)
        self._children: list[BaseGang] = []
        self._ops_left_in_backend = False
        self._released = False

    # Properties.

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def size(self) -> int:
        return self._size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    @override
    def backend(self) -> str:
        return self._backend

    @property
    @override
    def name(self) -> str:
        return self._name

    @property
    @override
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} '{self._name}' rank {self._rank} of {self._size} "
            f"{self._backend} {self._device}>"
        )

    # Primitives the implementations provide. Each starts the op and calls ``done``
    # exactly once, from any thread, when the backend has finished with the tensors.

    @abstractmethod
    def _start_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, done: Done) -> None: ...

    @abstractmethod
    def _start_all_gather(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        """``output`` is flat: ``size`` runs shaped like ``input``."""

    @abstractmethod
    def _start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None: ...

    @abstractmethod
    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        """``input`` is flat: ``size`` runs shaped like ``output``; it must stay unchanged."""

    @abstractmethod
    def _start_broadcast(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_all_to_all(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None: ...

    @abstractmethod
    def _start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None: ...

    @abstractmethod
    def _start_barrier(self, done: Done) -> None: ...

    def _abort_backend(self) -> None:
        """Stops the communicator after a failure; must not block. Default: nothing."""

    @abstractmethod
    def _release_backend(self, *, pending: bool) -> None:
        """Frees the backend on close; runs off the loop and may block briefly."""

    # Collectives.

    def _check_tensor(self, tensor: object, name: str) -> torch.Tensor:
        return check_tensor(tensor, name=name, device=self._device, backend=self._backend)

    @override
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        op = check_reduce_op(op)
        check_reduce_dtype(tensor, op, name="tensor")
        return self._issue(
            "all_reduce",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_all_reduce(tensor, op, done),
        )

    @override
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        check_same_dtype(output, input)
        check_shape(output, (self._size, *input.shape), name="output")
        flat = output.view(-1)
        return self._issue(
            "all_gather",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_all_gather(flat, input, done),
        )

    @override
    def all_gather_to_list(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        input = self._check_tensor(input, "input")
        items = check_tensor_list(outputs, name="outputs", length=self._size)
        checked = [self._check_tensor(t, f"outputs[{i}]") for i, t in enumerate(items)]
        for i, output in enumerate(checked):
            check_same_dtype(output, input)
            check_shape(output, input.shape, name=f"outputs[{i}]")
        busy = [(f"outputs[{i}]", t) for i, t in enumerate(checked)] + [("input", input)]
        return self._issue(
            "all_gather_to_list",
            busy,
            checked,
            timeout,
            lambda done: self._start_all_gather_to_list(checked, input, done),
        )

    @override
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        op = check_reduce_op(op)
        check_same_dtype(output, input)
        check_reduce_dtype(input, op, name="input")
        check_shape(input, (self._size, *output.shape), name="input")
        flat = input.view(-1)
        return self._issue(
            "reduce_scatter",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_reduce_scatter(output, flat, op, done),
        )

    @override
    def broadcast(
        self, tensor: torch.Tensor, source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self._size, name="source_rank")
        return self._issue(
            "broadcast",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_broadcast(tensor, source_rank, done),
        )

    @override
    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        input = self._check_tensor(input, "input")
        output = self._check_tensor(output, "output")
        check_same_dtype(output, input)
        check_shape(output, input.shape, name="output")
        if input.dim() == 0 or input.shape[0] % self._size:
            raise ValueError(
                f"`input` must have a first dimension that is a multiple of the gang's size "
                f"({self._size}), but has shape {tuple(input.shape)} instead."
            )
        return self._issue(
            "all_to_all",
            [("output", output), ("input", input)],
            output,
            timeout,
            lambda done: self._start_all_to_all(output, input, done),
        )

    @override
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        tensor = self._check_tensor(tensor, "tensor")
        destination_rank = check_rank(
            destination_rank, self._size, name="destination_rank", self_rank=self._rank
        )
        return self._issue(
            "send",
            [("tensor", tensor)],
            None,
            timeout,
            lambda done: self._start_send(tensor, destination_rank, done),
        )

    @override
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        tensor = self._check_tensor(tensor, "tensor")
        source_rank = check_rank(source_rank, self._size, name="source_rank", self_rank=self._rank)
        return self._issue(
            "recv",
            [("tensor", tensor)],
            tensor,
            timeout,
            lambda done: self._start_recv(tensor, source_rank, done),
        )

    @override
    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        return self._issue("barrier", [], None, timeout, self._start_barrier)

    @override
    def broadcast_objects(
        self, objects: list[Any], source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[list[Any]]:
        if not isinstance(objects, list):
            raise TypeError(
                f"`objects` must be a list, but is of type `{type(objects).__name__}` instead."
            )
        source_rank = check_rank(source_rank, self._size, name="source_rank")
        is_source = self._rank == source_rank
        payload = _objects.to_bytes(objects, name="objects") if is_source else None
        length = _objects.length_tensor(payload, self._device)

        def phase2(start: Callable[[Start, Callable[[], Any]], None]) -> None:
            buffer = _objects.byte_buffer(payload, int(length.item()), self._device)
            start(
                lambda done: self._start_broadcast(buffer, source_rank, done),
                lambda: objects if is_source else _objects.replace(objects, buffer),
            )

        return self._issue_two_phase(
            "broadcast_objects",
            timeout,
            len(payload or b""),
            lambda done: self._start_broadcast(length, source_rank, done),
            phase2,
        )

    @override
    def all_gather_objects(self, obj: Any, *, timeout: float | None = None) -> Handle[list[Any]]:
        payload = _objects.to_bytes(obj, name="obj")
        length = _objects.length_tensor(payload, self._device)
        lengths = torch.zeros(self._size, dtype=torch.int64, device=self._device)

        def phase2(start: Callable[[Start, Callable[[], Any]], None]) -> None:
            longest = int(lengths.max().item())
            buffer = _objects.byte_buffer(payload, longest, self._device)
            gathered = torch.empty(self._size * longest, dtype=torch.uint8, device=self._device)
            start(
                lambda done: self._start_all_gather(gathered, buffer, done),
                lambda: _objects.split(gathered, lengths, longest),
            )

        return self._issue_two_phase(
            "all_gather_objects",
            timeout,
            len(payload),
            lambda done: self._start_all_gather(lengths, length, done),
            phase2,
        )

    # Issuing.

    def _context(self, op: str, seq: int, timeout: float | None) -> OpContext:
        return OpContext(self._name, self._rank, self._size, op, seq, timeout)

    def _resolve_timeout(self, timeout: float | None) -> float | None:
        seconds = check_timeout(timeout)
        if seconds is None:
            return self._op_timeout
        return None if math.isinf(seconds) else seconds

    def _check_usable(self) -> None:
        if self._closed:
            raise GangClosedError(f"Gang '{self._name}' is closed; make a new one.")
        if self._broken is not None:
            raise GangBrokenError(
                f"Gang '{self._name}' is broken by an earlier failure and refuses every op: "
                f"{self._broken}",
                self._broken,
            ) from self._broken

    def _new_handle(
        self,
        op: str,
        timeout: float | None,
        busy: Sequence[tuple[str, torch.Tensor]],
        num_bytes: int | None = None,
    ) -> tuple[Handle[Any], _busy.Claim]:
        """Numbers the op and marks its tensors busy, atomically (rule 2)."""
        seconds = self._op_timeout if timeout is None else self._resolve_timeout(timeout)
        if self._closed or self._broken is not None:
            self._check_usable()
        if num_bytes is None:
            num_bytes = sum(t.numel() * t.element_size() for _, t in busy)
        with self._lock:
            seq = self._next_seq
            handle: Handle[Any] = Handle(op=op, seq=seq, num_bytes=num_bytes, timeout=seconds)
            claim = _busy.acquire(busy, handle)  # raises before anything is committed
            self._next_seq = seq + 1
            self._in_flight[seq] = handle
            self._bytes_in_flight += num_bytes
            self._counters.num_issued += 1
            self._counters.bytes_issued += num_bytes
        if seconds is not None:
            self._arm(handle.issued_at + seconds)
        return handle, claim

    def _issue(
        self,
        op: str,
        busy: Sequence[tuple[str, torch.Tensor]],
        output: T,
        timeout: float | None,
        start: Start,
    ) -> Handle[T]:
        handle, claim = self._new_handle(op, timeout, busy)

        def done(error: BaseException | None) -> None:
            _busy.release(claim)
            self._complete(handle, output, error)

        self._submit(lambda: self._start_guarded(start, done))
        return handle

    def _issue_two_phase(
        self,
        op: str,
        timeout: float | None,
        num_bytes: int,
        phase1: Start,
        phase2: Callable[[Callable[[Start, Callable[[], Any]], None]], None],
    ) -> Handle[Any]:
        """Issues an op whose second step depends on the first one's result (rule 2)."""
        handle, _ = self._new_handle(op, timeout, [], num_bytes)

        def start_second(start: Start, result: Callable[[], Any]) -> None:
            def done(error: BaseException | None) -> None:
                if error is not None:
                    self._complete(handle, None, error)
                    return
                try:
                    value = result()
                except Exception as exc:  # a payload that does not unpickle
                    self._complete(handle, None, exc)
                    return
                self._complete(handle, value, None)

            self._start_guarded(start, done)

        def after_first(error: BaseException | None) -> None:
            if error is not None:
                self._complete(handle, None, error)
                return
            with self._lock:
                if self._broken is None and not self._closed:
                    phase2(start_second)
                self._open_gate()

        def first() -> None:
            self._gate_held = True
            self._start_guarded(phase1, after_first)

        self._submit(first)
        return handle

    def _submit(self, start: Callable[[], None]) -> None:
        with self._lock:
            if self._gate_held or self._deferred:
                self._deferred.append(self._later(start))
                return
            start()

    def _later(self, start: Callable[[], None]) -> Callable[[], None]:
        """Wraps a start that will run later, on another thread, as if run now.

        The default needs nothing; CUDA gangs restore the caller's current stream.
        """
        return start

    def _open_gate(self) -> None:
        # The caller holds the lock. Started ops may take the gate again (rule 2).
        self._gate_held = False
        while self._deferred and not self._gate_held:
            self._deferred.popleft()()

    def _start_guarded(self, start: Start, done: Done) -> None:
        try:
            start(done)
        except Exception as exc:
            done(exc)

    # Completion, deadlines, failure.

    def _complete(self, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._in_flight.pop(handle.seq, None) is not None:
                self._bytes_in_flight -= handle.num_bytes
        if error is None:

            def count_completed() -> None:
                with self._lock:
                    self._counters.num_completed += 1
                    self._counters.latencies.append(handle.elapsed or 0.0)
                    self._recent.append(handle)

            handle._finish(value, None, then=count_completed)
            return
        if isinstance(error, GangBrokenError | GangClosedError | CollectiveError):
            wrapped: BaseException = error
        else:
            context = self._context(handle.op, handle.seq, handle.timeout)
            wrapped = CollectiveError(f"{context.describe()} failed: {error}", context)
            wrapped.__cause__ = error

        def count_failed_and_break() -> None:
            with self._lock:
                self._counters.num_failed += 1
            self._break(wrapped)

        # Broken before the waiters wake: their next call must be refused (rule 5).
        handle._finish(None, wrapped, then=count_failed_and_break)

    def _arm(self, deadline: float) -> None:
        driver = _deadline.current_driver()
        with self._lock:
            if (
                self._armed_at is not None
                and self._armed_at <= deadline
                and self._armed_driver is driver
                and _deadline.alive(driver)
            ):
                return
            self._armed_at = deadline
            self._armed_driver = driver
        _deadline.call_at(driver, deadline, self._check_deadlines)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        due = []
        earliest = math.inf
        with self._lock:
            self._armed_at = None
            for handle in self._in_flight.values():
                if handle.done() or handle.timeout is None:
                    continue
                deadline = handle.issued_at + handle.timeout
                if deadline <= now:
                    due.append(handle)
                else:
                    earliest = min(earliest, deadline)
        if earliest < math.inf:
            self._arm(earliest)
        for handle in due:
            self._expire(handle, now)

    def _expire(self, handle: Handle[Any], now: float) -> None:
        with self._lock:
            in_flight = [
                f"{h.op} seq={h.seq} issued {now - h.issued_at:.3f} s ago"
                for h in self._in_flight.values()
                if h is not handle and not h.done()
            ]
            recent = [f"{h.op} seq={h.seq} {1000 * (h.elapsed or 0):.1f} ms" for h in self._recent]
        context = self._context(handle.op, handle.seq, handle.timeout)
        elapsed = now - handle.issued_at
        error = GangTimeoutError(
            f"{context.describe()} timed out after {elapsed:.3f} s; a peer may be late, "
            f"stopped, or issuing its ops in another order. The gang is now broken.",
            context,
            elapsed=elapsed,
            in_flight=in_flight,
            recent=recent,
        )

        def count_timed_out_and_break() -> None:
            with self._lock:
                self._counters.num_timed_out += 1
            self._break(error)

        # Broken before the waiters wake: their next call must be refused (rule 5).
        handle._finish(None, error, then=count_timed_out_and_break)

    def _break(self, cause: BaseException) -> None:
        with self._lock:
            if self._broken is not None or self._closed:
                return
            self._broken = cause
            pending = [h for h in self._in_flight.values() if not h.done()]
            self._deferred.clear()
            self._counters.num_failed += len(pending)
        log.error("Gang '%s' (rank %d) is broken: %s", self._name, self._rank, cause)
        for handle in pending:
            error = GangBrokenError(
                f"`{handle.op}` (seq {handle.seq}) on gang '{self._name}' was abandoned: "
                f"the gang broke on an earlier failure: {cause}",
                cause,
            )
            error.__cause__ = cause
            handle._finish(None, error)
        try:
            self._abort_backend()
        except Exception:
            log.exception("Aborting the communicator of gang '%s' failed.", self._name)

    # Lifecycle.

    def _mark_closed(self) -> None:
        """Closes this gang and its sub-gangs at once: pending waiters fail right away."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [h for h in self._in_flight.values() if not h.done()]
            self._ops_left_in_backend = bool(self._in_flight)
            self._deferred.clear()
            self._counters.num_failed += len(pending)
            children = list(self._children)
        for handle in pending:
            handle._finish(
                None,
                GangClosedError(
                    f"`{handle.op}` (seq {handle.seq}) was pending when gang "
                    f"'{self._name}' was closed."
                ),
            )
        for child in children:
            child._mark_closed()

    def _release_all(self) -> None:
        """Frees the backends of this gang's sub-gangs, then its own; may block briefly."""
        with self._lock:
            if self._released:
                return
            self._released = True
            children = list(self._children)
        for child in children:
            child._release_all()
        self._release_backend(pending=self._ops_left_in_backend)

    @override
    async def close(self) -> None:
        if self._closed:
            return
        from agang._offload import run_blocking

        self._mark_closed()
        await run_blocking(
            self._release_all, name=f"close gang '{self._name}'", seconds=self._close_timeout()
        )

    @override
    def close_sync(self) -> None:
        if self._closed:
            return
        self._mark_closed()
        self._release_all()

    def _close_timeout(self) -> float:
        return 5.0

    @override
    def statistics(self) -> GangStatistics:
        with self._lock:
            return self._counters.snapshot(
                num_in_flight=len(self._in_flight), bytes_in_flight=self._bytes_in_flight
            )
