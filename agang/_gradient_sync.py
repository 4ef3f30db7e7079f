"""Data-parallel gradient synchronisation that overlaps the all-reduces with backward.

Rules:
1. Buckets are fixed at construction, equal on every rank, and are DDP's: the trainable
   parameters in reverse registration order (the order backward tends to produce their
   gradients, as DDP assumes), one open bucket per dtype and device, each closed as soon
   as it holds at least its limit (the parameter that reaches it included), the first
   of each kind with ``first_bucket_bytes`` (the last layers, whose gradients come
   first: communication starts early in backward), the rest with ``bucket_bytes``; then
   ordered by their first parameter (``plan_like_ddp``). Fewer, fuller buckets than a
   hard cap makes: each all-reduce costs a fixed time, which a small model feels.
2. Each parameter's gradient lives in its bucket's buffer (a view, as DDP's
   ``gradient_as_bucket_view``): autograd accumulates straight into it. Where autograd
   handed over a fresh tensor instead (the first step, or after ``zero_grad`` set the
   gradient to None), the hook, or ``wait()`` for a parameter that got no gradient in
   the synchronised step (rule 4), copies it in and points ``.grad`` at the view again.
3. A post-accumulate-grad hook counts each bucket's ready parameters; a full bucket is
   all-reduced at once, while backward goes on. Buckets are issued strictly in index
   order: a bucket that fills early waits for the ones before it, so every rank issues
   the same ops in the same order whatever order its hooks fire in.
4. *Every bucket is issued before ``backward()`` returns*, as DDP does: the first hook
   of a synchronised backward queues a callback that autograd runs at the end of that
   backward, which issues, in order, the buckets still open. Otherwise a bucket holding
   a parameter that got no gradient on one rank (an expert no token reached) would be
   issued only by ``wait()``, and strict order would hold back every later bucket: an
   op the user issues between ``backward()`` and ``wait()`` (a loss metric's
   all-reduce) would then pair with a gradient bucket on the other ranks, corrupting
   both, silently. So one synchronised backward per step: a second one before
   ``wait()`` that gives a parameter a gradient is refused (use ``no_sync()`` for the
   backwards that accumulate). As with DDP, reentrant activation checkpointing (a
   backward inside the backward) ends the step early: use torch's non-reentrant
   checkpointing. A parameter that got no gradient this step contributes
   what its ``.grad`` holds (a sum accumulated under ``no_sync()``), or zeros where
   ``.grad`` is None (no gradient since ``zero_grad`` cleared it), as DDP with
   ``find_unused_parameters=True`` does. Unlike DDP, a parameter whose ``.grad`` was
   None on every rank ends with a zero gradient rather than None. ``wait()`` issues
   what is still open (a step whose backward gave this model no gradient at all),
   then waits for every bucket. Gradients are final after it returns. Reading
   ``.grad`` is the only record needed: no per-hook bookkeeping.
5. Inside ``no_sync()``, hooks do nothing: gradients accumulate locally, and the next
   ``wait()`` reduces the accumulated sum, whether or not the synchronised backward
   gives that parameter a gradient too (rule 4).
6. The parameters (and buffers) are broadcast from ``source_rank`` when the object is
   made; ``ready()`` waits for that, and a forward pass before it raises.
7. On a device with streams (NCCL), device work follows the streams that hold its
   inputs, as in DDP: a bucket is issued on the stream its first gradient came from
   (backward's), also when ``wait()`` issues it from another thread, so the
   all-reduce reads accumulated gradients; the broadcast parameters are copied in by
   ``ready()`` (or the first forward) on the caller's current stream, never on an agang
   thread's; and where the gang reports ops once ordered (stream-ordered mode),
   ``wait()`` and that copy first make the caller's current stream wait for the ops.
8. ``MEAN`` is DDP's: each gradient is multiplied by ``1 / size`` as it is copied into
   (or, already there, in) its bucket, and the buckets are summed. The division costs no
   pass of its own, and none after the all-reduce, where it would delay the step's end.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, final

import torch

from agang._backends.cuda.runtime import DeviceEvent
from agang._engine.grouping import flatten, unflatten_into
from agang._gang import Gang, stream_order_of
from agang._handle import Handle, all_of
from agang._reduce_op import ReduceOp
from agang._runtime.future import Future, add_done_callback, finish
from agang._validate import check_positive_int, check_rank, check_reduce_op, check_timeout

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(eq=False)
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    num_pending: int = 0
    ready: set[int] = field(default_factory=set)  # positions in ``params``
    handle: Handle[torch.Tensor] | None = None
    stream: Any = None  # where its first gradient of the step came from (rule 7)
    ordered: DeviceEvent | None = None  # after its all-reduce, in stream-ordered mode


@dataclass(frozen=True)
class BucketTimes:
    """One bucket's all-reduce in the last synchronised step (monotonic seconds)."""

    index: int
    num_bytes: int
    issued_at: float
    finished_at: float


@dataclass(frozen=True)
class StepTimes:
    """When communication ran in the last synchronised step, and how much was hidden.

    Attributes:
        buckets: Each bucket's all-reduce, in issue order.
        wait_started: When [`GradientSync.wait`][agang.GradientSync.wait] was called.
        wait_finished: When it returned.
        exposed: Seconds ``wait`` blocked for communication that backward did not hide.
        communication: Seconds from the first bucket's issue to the last one's finish.
        hidden_share: ``1 - exposed / communication``: the share of communication time
            overlapped with compute (1.0 when nothing was left to wait for).
    """

    buckets: tuple[BucketTimes, ...]
    wait_started: float
    wait_finished: float

    @property
    def exposed(self) -> float:
        """Seconds the step waited for communication after backward (not hidden by it)."""
        return self.wait_finished - self.wait_started

    @property
    def communication(self) -> float:
        """Seconds from the first bucket's issue to the last bucket's end."""
        if not self.buckets:
            return 0.0
        return max(b.finished_at for b in self.buckets) - min(b.issued_at for b in self.buckets)

    @property
    def hidden_share(self) -> float:
        """The share of the communication that backward hid, from 0 to 1."""
        if self.communication <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.exposed / self.communication))


@final
class GradientSync:
    """All-reduces a model's gradients bucket by bucket while backward runs (like DDP).

    Args:
        model: The replica on this rank; its trainable parameters are synchronised.
        gang: The data-parallel gang.
        bucket_bytes: A bucket's limit: it closes once it holds at least this many bytes
            (DDP's ``bucket_cap_mb``, in bytes).
        first_bucket_bytes: The first bucket's limit (filled first by backward); a small
            one lets communication start early, as in DDP.
        op: How gradients are combined; ``MEAN`` averages them, as DDP does.
        source_rank: The rank whose parameters and buffers every replica starts from.
        timeout: Seconds before each bucket's deadline; None for the gang's default.

    Example:
        <!-- not-run: a training loop: the model, data and optimizer are yours -->
        ```python
        sync = agang.GradientSync(model, gang)
        await sync.ready()                  # parameters equal on every rank
        for batch in data:
            loss = model(batch).sum()
            loss.backward()                 # buckets are all-reduced meanwhile
            await sync.wait()               # gradients are averaged
            optimizer.step(); optimizer.zero_grad()
        ```
    """

    def __init__(
        self,
        model: torch.nn.Module,
        gang: Gang,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
        op: ReduceOp = ReduceOp.MEAN,
        source_rank: int = 0,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"`model` must be a torch.nn.Module, but is of type `{type(model).__name__}` "
                f"instead."
            )
        if not isinstance(gang, Gang):
            raise TypeError(
                f"`gang` must be an agang.Gang, but is of type `{type(gang).__name__}` instead."
            )
        self._gang = gang
        self._order = stream_order_of(gang)
        op = check_reduce_op(op)
        # MEAN divides while copying into the bucket, then sums (rule 8).
        self._scale = 1.0 / gang.size if op is ReduceOp.MEAN and gang.size > 1 else None
        self._op = ReduceOp.SUM if op is ReduceOp.MEAN else op
        self._bucket_bytes = check_positive_int(bucket_bytes, name="bucket_bytes")
        self._first_bucket_bytes = min(
            check_positive_int(first_bucket_bytes, name="first_bucket_bytes"), self._bucket_bytes
        )
        self._timeout = check_timeout(timeout)
        source_rank = check_rank(source_rank, gang.size, name="source_rank")
        params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
        for i, param in enumerate(params):
            if param.device != gang.device:
                raise ValueError(
                    f"`model` must have its parameters on the gang's device ({gang.device}), "
                    f"but parameter {i} is on {param.device} instead."
                )
        self._lock = threading.Lock()
        self._buckets = self._make_buckets(list(reversed(params)))
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next_to_issue = 0
        self._end_queued = False  # this step's end-of-backward callback (rule 4)
        self._synchronising = True
        self._last_step: StepTimes | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient)  # type: ignore[no-untyped-call]
            for p in params
        ]
        self._install: Callable[[], None] | None = None  # the copy ``ready()`` makes
        self._ready = self._broadcast_state(model, source_rank)
        self._forward_check = model.register_forward_pre_hook(self._check_ready)

    def _make_buckets(self, params: list[torch.nn.Parameter]) -> list[_Bucket]:
        keys = [((p.dtype, p.device), p.numel() * p.element_size()) for p in params]
        plan = plan_like_ddp(keys, self._first_bucket_bytes, self._bucket_bytes)
        buckets = []
        for index, members in enumerate(plan):
            chosen = [params[i] for i in members]
            buffer = torch.zeros(
                sum(p.numel() for p in chosen), dtype=chosen[0].dtype, device=chosen[0].device
            )
            views = [
                part.view_as(p)
                for part, p in zip(
                    torch.split(buffer, [p.numel() for p in chosen]), chosen, strict=True
                )
            ]
            buckets.append(_Bucket(index, chosen, buffer, views, num_pending=len(chosen)))
        return buckets

    def _broadcast_state(self, model: torch.nn.Module, source_rank: int) -> Future[Any]:
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel()]
        tensors = list({id(t): t for t in tensors}.values())
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        broadcasts = []
        for members in groups.values():
            flat = flatten([t.detach() for t in members])
            handle = self._gang.broadcast(flat, source_rank, timeout=self._timeout)
            broadcasts.append((handle, flat, members))
        everything = all_of([b[0] for b in broadcasts], None, op="broadcast parameters")
        done: Future[Any] = Future("broadcast parameters")
        order = self._order
        ordered = order.mark() if order is not None and order.stream_ordered else None

        def copy_back() -> None:
            with torch.no_grad():
                for _, flat, members in broadcasts:
                    unflatten_into(flat, [t.detach() for t in members])

        def install() -> None:  # on the caller's thread and stream (rule 7)
            assert order is not None
            if ordered is not None:
                order.wait(ordered)
            order.run_here(copy_back)

        def finished() -> None:
            error = everything.exception()
            if error is None and order is None:
                copy_back()  # on a CPU the copy is the work itself: off the loop
            finish(done, None, error)

        self._install = install if order is not None else None
        add_done_callback(everything, finished)
        return done

    def _install_parameters(self) -> None:
        """Queues the broadcast parameters' copy on the caller's stream, once (rule 7)."""
        with self._lock:
            install, self._install = self._install, None
        if install is not None:
            install()

    # The user's side.

    async def ready(self) -> None:
        """Waits until every replica holds the source rank's parameters and buffers.

        On a GPU, the copy into the parameters is queued on the caller's current
        stream: run forward on that stream, or after it.
        """
        await self._ready
        self._install_parameters()

    def ready_sync(self, timeout: float | None = None) -> None:
        """[`ready`][agang.GradientSync.ready] for synchronous code."""
        self._ready.wait(timeout)
        self._install_parameters()

    def _check_ready(self, module: torch.nn.Module, args: Any) -> None:
        if not self._ready.done():
            raise RuntimeError(
                "The model ran forward before GradientSync's parameter broadcast finished; "
                "`await sync.ready()` (or `sync.ready_sync()`) first."
            )
        self._ready.result()  # raises the broadcast's error, if any
        self._install_parameters()
        self._forward_check.remove()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally; the next synchronised step reduces the sum.

        The sum is reduced even for a parameter that the synchronised backward leaves
        without a gradient (rule 4), as DDP with ``find_unused_parameters=True`` does.

        Example:
            <!-- not-run: a fragment of a training loop with gradient accumulation -->
            ```python
            with sync.no_sync():
                model(micro_batch).sum().backward()
            ```
        """
        self._synchronising = False
        try:
            yield
        finally:
            self._synchronising = True

    async def wait(self) -> None:
        """Issues the buckets still open, then waits for all; gradients are then final.

        Raises:
            GangError: A bucket's all-reduce failed or missed its deadline.
        """
        started = time.monotonic()
        handles = self._finish_step()
        for handle in handles:
            await handle
        self._order_callers_stream()
        self._end_step(handles, started)

    def wait_sync(self, timeout: float | None = None) -> None:
        """[`wait`][agang.GradientSync.wait] for synchronous code; ``timeout`` bounds each
        bucket's wait."""
        started = time.monotonic()
        handles = self._finish_step()
        for handle in handles:
            handle.wait(timeout)
        self._order_callers_stream()
        self._end_step(handles, started)

    @property
    def num_buckets(self) -> int:
        """How many buckets the gradients are all-reduced in."""
        return len(self._buckets)

    def last_step(self) -> StepTimes | None:
        """When communication ran in the last synchronised step, for timelines."""
        return self._last_step

    def remove(self) -> None:
        """Removes the hooks: the model trains without synchronisation again."""
        for hook in self._hooks:
            hook.remove()
        self._forward_check.remove()

    # The hooks' side (rules 2 and 3).

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._synchronising:
            return
        bucket, position = self._where[id(param)]
        view = bucket.views[position]
        grad = param.grad
        if grad is not None:
            self._take(param, grad, view)
        with self._lock:
            if position in bucket.ready:
                raise RuntimeError(
                    "A parameter got a second gradient before `GradientSync.wait()`: its "
                    "bucket is in flight already (each synchronised backward issues every "
                    "bucket by its end, as DDP does). Call `wait()` after each backward, or "
                    "accumulate inside `with sync.no_sync():`; with activation "
                    "checkpointing, use `use_reentrant=False` (a reentrant one runs "
                    "backwards inside the backward)."
                )
            bucket.ready.add(position)
            bucket.num_pending -= 1
            if self._order is not None and bucket.stream is None:
                bucket.stream = self._order.current()
            self._issue_ready_buckets()
            if not self._end_queued:  # rule 4: the rest goes at the end of this backward
                self._end_queued = True
                _execution_engine().queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Autograd's callback at the end of a synchronised backward (rule 4)."""
        self._issue_open_buckets()

    def _on_stream_of(self, bucket: _Bucket) -> contextlib.AbstractContextManager[None]:
        """Inside: the stream of the bucket's gradients is current (rule 7)."""
        if self._order is None or bucket.stream is None:
            return contextlib.nullcontext()
        return self._order.use(bucket.stream)

    def _issue_ready_buckets(self) -> None:
        # The caller holds the lock (rule 3).
        order = self._order
        while self._next_to_issue < len(self._buckets):
            bucket = self._buckets[self._next_to_issue]
            if bucket.num_pending:
                return
            with self._on_stream_of(bucket):
                bucket.handle = self._gang.all_reduce(
                    bucket.buffer, self._op, timeout=self._timeout
                )
                if order is not None and order.stream_ordered:
                    bucket.ordered = order.mark()
            self._next_to_issue += 1

    def _order_callers_stream(self) -> None:
        """Stream-ordered mode: the caller's stream waits for every bucket (rule 7)."""
        for bucket in self._buckets:
            if bucket.ordered is not None and self._order is not None:
                self._order.wait(bucket.ordered)

    def _issue_open_buckets(self) -> None:
        """Rule 4: issues the open buckets, with what ``.grad`` holds (or zeros), in order."""
        with self._lock:
            for bucket in self._buckets[self._next_to_issue :]:
                with self._on_stream_of(bucket):
                    self._fill_missing(bucket)
            self._issue_ready_buckets()

    def _finish_step(self) -> list[Handle[torch.Tensor]]:
        """The step's buckets, every one issued (rule 4)."""
        self._issue_open_buckets()
        with self._lock:
            return [b.handle for b in self._buckets if b.handle is not None]

    def _take(self, param: torch.Tensor, grad: torch.Tensor, view: torch.Tensor) -> None:
        """Puts ``param``'s gradient into its bucket's ``view``, scaled for MEAN (rules 2
        and 8), and points ``.grad`` at the view."""
        if grad.layout != torch.strided:
            raise TypeError(
                f"GradientSync reduces dense gradients only, but a parameter of shape "
                f"{tuple(param.shape)} got a {grad.layout} one (an embedding with "
                f"sparse=True?); use a dense gradient, or reduce this one yourself."
            )
        scale = self._scale
        if grad.data_ptr() != view.data_ptr():
            if scale is None:
                view.copy_(grad)
            else:
                torch.mul(grad, scale, out=view)
            param.grad = view
        elif scale is not None:
            view.mul_(scale)

    def _fill_missing(self, bucket: _Bucket) -> None:
        for position, (param, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
            if position in bucket.ready:
                continue
            # No gradient this step, but ``.grad`` may hold one accumulated under
            # ``no_sync()``: in the view already, or in a fresh tensor when it was None
            # before. None means no gradient since the last clear.
            grad = param.grad
            if grad is None:
                view.zero_()
                param.grad = view
            else:
                self._take(param, grad, view)
            bucket.ready.add(position)
            bucket.num_pending -= 1

    def _end_step(self, handles: list[Handle[torch.Tensor]], started: float) -> None:
        finished = time.monotonic()
        self._last_step = StepTimes(
            tuple(
                BucketTimes(
                    b.index,
                    b.buffer.numel() * b.buffer.element_size(),
                    b.handle.issued_at,
                    b.handle.issued_at + (b.handle.elapsed or 0.0),
                )
                for b in self._buckets
                if b.handle is not None
            ),
            started,
            finished,
        )
        with self._lock:
            for bucket in self._buckets:
                bucket.ready.clear()
                bucket.num_pending = len(bucket.params)
                bucket.handle = None
                bucket.stream = bucket.ordered = None
            self._next_to_issue = 0
            self._end_queued = False


def _execution_engine() -> Any:
    """Autograd's engine, whose ``queue_callback`` runs a function at the end of the
    backward that is running (what DDP uses for the same purpose)."""
    return torch.autograd.Variable._execution_engine


def plan_like_ddp(
    items: Sequence[tuple[Hashable, int]], first_limit: int, limit: int
) -> list[list[int]]:
    """DDP's bucket assignment (rule 1): ``(key, num_bytes)`` items in order, one open
    bucket per key, closed once it holds at least its limit (``first_limit`` for a key's
    first bucket, ``limit`` after), the buckets ordered by their first item. Equal to
    ``torch.distributed._compute_bucket_assignment_by_size`` (tested)."""
    done: list[list[int]] = []
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    closed_per_key: dict[Hashable, int] = {}
    for index, (key, num_bytes) in enumerate(items):
        members, total = open_buckets.get(key, ([], 0))
        members.append(index)
        total += num_bytes
        bound = first_limit if closed_per_key.get(key, 0) == 0 else limit
        if total >= bound:
            done.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, total)
    done.extend(members for members, _ in open_buckets.values())
    return sorted(done, key=lambda members: members[0])
