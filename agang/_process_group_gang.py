"""The gang over a c10d process group: Gloo on CPU, NCCL on CUDA.

How an op's end reaches agang:
1. Gloo collectives: the Work future's callback, on a Gloo worker thread (or inline when
   already done). It only finishes the op's post-processing and calls ``done``.
2. Gloo send/recv and reduce_scatter have no future ("Work::getFuture not implemented"),
   so a waiter thread per gang and kind waits on them in issue order. A later send that
   finishes before an earlier one is reported after it: late, never wrong.
3. NCCL: the future only means "enqueued", so completion goes through
   ``_cuda_completion`` (an event on a side stream, one watcher thread per process).

c10d's own timeout is a backstop behind agang's deadline: it is raised (``set_timeout``)
past the longest deadline asked for, so c10d never fails an op before agang would, and
an op whose waiters are all gone still ends, and frees its threads, eventually. A gang
that breaks, or closes with work running, aborts its groups (``_abort``), which on Gloo
too ends the running work at once.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, final

import torch
import torch.distributed as dist
from typing_extensions import override

from agang import _cuda_completion, _exit
from agang._abort import Aborter
from agang._base_gang import BaseGang
from agang._errors import GangClosedError, GangInitError
from agang._gang import Gang
from agang._issuing import Checked, Done, after_post
from agang._offload import run_blocking, start_thread
from agang._policy import GangPolicy
from agang._reduce_op import ReduceOp, to_c10d
from agang._setup.retry import RetryPolicy, retrying
from agang._validate import check_member_ranks

log = logging.getLogger("agang")

# c10d's deadline sits this far behind agang's, so agang's always fires first.
_BACKSTOP_FACTOR = 1.5
_BACKSTOP_MARGIN = 30.0
_DEFAULT_BACKSTOP = 1800.0

# A rank whose op timed out in its order check waits this long for the other ranks stuck
# at the same check to say so (they time out at about the same moment); the rest are
# named as absent (``_issuing`` rule 4).
_CENSUS_SECONDS = 0.25

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backstop_for(timeout: float | None) -> float:
    """The c10d timeout to use behind an agang deadline of ``timeout`` seconds."""
    if timeout is None:
        return _DEFAULT_BACKSTOP
    return max(timeout * _BACKSTOP_FACTOR + _BACKSTOP_MARGIN, _BACKSTOP_MARGIN)


# A process group still alive at interpreter exit can abort the process ("terminate
# called without an active exception", seen with raw c10d too once future callbacks
# were used), so the world gangs still open are closed at exit (``_exit``, within its
# bound): their running work is aborted, their threads end.
_open_world_gangs: weakref.WeakSet[ProcessGroupGang] = weakref.WeakSet()


def _close_open_gangs() -> None:
    for gang in [gang for gang in list(_open_world_gangs) if not gang.closed]:
        gang.close_sync()


_exit.add_closer(_close_open_gangs)


def _all_reduce_options(op: ReduceOp, backend: str) -> tuple[dist.AllreduceOptions, bool]:
    c10d_op, divide = to_c10d(op, backend=backend)
    options = dist.AllreduceOptions()
    options.reduceOp = c10d_op  # type: ignore[assignment]  # stubs want the enum's class
    return options, divide


def _divider(tensor: torch.Tensor, size: int) -> Callable[[], None]:
    def divide() -> None:
        tensor.div_(size)

    return divide


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


def _real(tensor: torch.Tensor) -> torch.Tensor:
    # c10d reduces complex tensors as pairs of reals.
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


class _WorkWaiter:
    """A thread that waits on Work in issue order, for Work that has no future."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Done] | None] = queue.SimpleQueue()
        _exit.start_daemon(self._run, name=f"agang-wait {name}")

    def watch(self, work: Any, done: Done) -> None:
        self._queue.put((work, done))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done = item
            try:
                work.wait()
            except Exception as exc:
                done(exc)
            else:
                done(None)


@final
class ProcessGroupGang(BaseGang):
    """A gang backed by a c10d process group. Made by :func:`agang.init`."""

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        device: torch.device,
        backend: str,
        name: str,
        policy: GangPolicy,
        is_world: bool,
        stream_ordered: bool = False,
        order_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            rank=process_group.rank(),
            size=process_group.size(),
            device=device,
            backend=backend,
            name=name,
            policy=policy,
        )
        if policy.check_order and order_group is None:
            raise ValueError("`order_group` must be given when the policy checks order.")
        self._pg = process_group
        self._order_group = order_group
        self._is_world = is_world
        self._stream_ordered = stream_ordered
        self._backstop = 0.0
        # Waiters by kind of Work: a recv that waits for its peer must not hold back the
        # report of a finished collective, so the two kinds never share one.
        self._waiters: dict[str, _WorkWaiter] = {}
        self._aborter = Aborter()
        self._raise_backstop(policy.op_timeout)
        # c10d copies the options on each call, so one object per op serves every call.
        self._all_reduce_options = {op: _all_reduce_options(op, backend) for op in ReduceOp}
        if is_world:
            _open_world_gangs.add(self)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The c10d process group, for calling torch.distributed directly.

        Raises:
            GangClosedError: The gang was closed and its group destroyed.
        """
        try:
            return self._pg
        except AttributeError:
            raise GangClosedError(f"Gang '{self.name}' is closed; its group is gone.") from None

    def _raise_backstop(self, timeout: float | None) -> None:
        backstop = backstop_for(timeout)
        if backstop <= self._backstop:
            return
        for group, _ in self._groups():  # none once closed: the call is refused next
            group.set_timeout(timedelta(seconds=backstop))
        self._backstop = backstop

    @override
    def _resolve_timeout(self, timeout: float | None) -> float | None:
        seconds = super()._resolve_timeout(timeout)
        if seconds is not None and backstop_for(seconds) > self._backstop:
            self._raise_backstop(seconds)
        return seconds

    @override
    def _later(self, start: Callable[[], None]) -> Callable[[], None]:
        if self._device.type != "cuda":
            return start
        # A deferred op starts on a backend thread; order it after the work that was on
        # the caller's stream when it called, not after that thread's default stream.
        stream = torch.cuda.current_stream(self._device)

        def start_on_callers_stream() -> None:
            with torch.cuda.stream(stream):
                start()

        return start_on_callers_stream

    # Completion routing.

    def _watch(self, work: Any, done: Done, post: Callable[[], None] | None = None) -> None:
        if self._backend == "nccl":
            _cuda_completion.watch(
                work, self._device, done, post, stream_ordered=self._stream_ordered
            )
            return

        finish = after_post(post, done)

        def on_future(future: Any) -> None:
            try:
                future.value()  # raises c10d's error, if any
            except Exception as exc:
                finish(exc)
            else:
                finish(None)

        try:
            future = work.get_future()
        except RuntimeError:
            # Gloo's reduce_scatter Work has no future ("Work::getFuture not implemented").
            self._waiter("collectives").watch(work, finish)
            return
        future.add_done_callback(on_future)

    def _waiter(self, kind: str) -> _WorkWaiter:
        with self._lock:
            waiter = self._waiters.get(kind)
            if waiter is None:
                waiter = self._waiters[kind] = _WorkWaiter(f"{self.name} {kind}")
            return waiter

    # Primitives.

    @override
    def _start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        options, divide = self._all_reduce_options[op]
        work = self._pg.allreduce([_real(tensor)], options)
        if divide:
            post = _then(_divider(tensor, self._size), post)
        self._watch(work, done, post)

    @override
    def _start_all_gather(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        # Gloo concatenates along the first dimension: the input must be flat like the
        # output, or a 2-D or 0-dim input fails ("invalid tensor size at index 0").
        flat_input = _real(input.view(-1))
        work = _all_gather_flat(_real(output), flat_input, group=self._pg, async_op=True)
        self._watch(work, done)

    @override
    def _start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        work = self._pg.allgather([[_real(t) for t in outputs]], [_real(input)])
        self._watch(work, done)

    @override
    def _start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        c10d_op, divide = to_c10d(op, backend=self._backend)
        work = _reduce_scatter_flat(
            _real(output.view(-1)), _real(input), op=c10d_op, group=self._pg, async_op=True
        )
        self._watch(work, done, _divider(output, self._size) if divide else None)

    @override
    def _start_broadcast(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = source_rank
        options.rootTensor = 0
        work = self._pg.broadcast([_real(tensor)], options)
        self._watch(work, done)

    @override
    def _start_all_to_all(self, output: torch.Tensor, input: torch.Tensor, done: Done) -> None:
        work = dist.all_to_all_single(_real(output), _real(input), group=self._pg, async_op=True)
        self._watch(work, done)

    def _watch_p2p(self, work: Any, done: Done) -> None:
        if self._backend == "nccl":
            self._watch(work, done)
            return
        self._waiter("send/recv").watch(work, done)

    @override
    def _start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        self._watch_p2p(self._pg.send([_real(tensor)], destination_rank, 0), done)

    @override
    def _start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        self._watch_p2p(self._pg.recv([_real(tensor)], source_rank, 0), done)

    @override
    def _start_barrier(self, done: Done) -> None:
        options = dist.BarrierOptions()
        if self._backend == "nccl" and self._device.index is not None:
            options.device_ids = [self._device.index]
        self._watch(self._pg.barrier(options), done)

    # Failure and lifecycle.

    @override
    def _abort_backend(self) -> None:
        # An abort can take a moment; never on the caller's (maybe the loop's) thread.
        groups = self._groups()
        if groups:  # none: a close on another thread has released them already
            _ = start_thread(lambda: self._aborter.abort(groups), name=f"abort gang '{self.name}'")

    def _groups(self) -> list[tuple[dist.ProcessGroup, str]]:
        """The gang's groups and their backends, while it holds them."""
        group, order_group = getattr(self, "_pg", None), self._order_group
        groups = [] if group is None else [(group, self._backend)]
        if order_group is not None:
            groups.append((order_group, "gloo"))
        return groups

    @override
    def _release_backend(self, *, pending: bool) -> None:
        for waiter in self._waiters.values():
            waiter.stop()
        unfinished = pending or self._broken is not None
        try:
            if unfinished:
                # Work still running would make destroy (NCCL) or the group's destructor
                # (Gloo) wait for it, for ever if the peer is hung: end it first (or let
                # the abort that a failure started end).
                self._aborter.abort(self._groups())
            if self._order_group is not None:
                dist.destroy_process_group(self._order_group)
            if self._is_world:
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(self._pg)
        except Exception:
            log.warning(
                "Releasing the process group of gang '%s' failed.", self.name, exc_info=True
            )
        # Drop our reference here, on the closing thread (with no work left running, the
        # destructor returns at once). Completion callbacks hold the
        # gang and are freed on c10d's threads; if the gang still held the group then,
        # its destructor could run on its own worker thread and abort the process
        # ("Resource deadlock avoided": a thread joining itself).
        del self._pg
        self._order_group = None

    # Order checking (``_issuing`` rule 7).

    @override
    def _start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        # Each rank's 8-byte digest is gathered on the side group; only on a mismatch
        # are the fingerprints' texts exchanged, through the store, off the loop.
        assert self._order_group is not None
        digest = hashlib.blake2b(fingerprint.encode(), digest_size=8).digest()
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)])
        gathered = torch.empty(self._size, dtype=torch.int64)
        work = _all_gather_flat(gathered, mine, group=self._order_group, async_op=True)

        def on_gathered(future: Any) -> None:
            try:
                future.value()
            except Exception as exc:
                checked(None, exc)
                return
            digests = gathered.tolist()
            if len(set(digests)) == 1:
                checked(None, None)
                return
            _ = start_thread(
                lambda: self._exchange_fingerprints(index, fingerprint, digests, checked),
                name=f"order mismatch on '{self.name}'",
            )

        work.get_future().add_done_callback(on_gathered)

    @override
    def _start_census(self, index: int, report: Callable[[list[int] | None], None]) -> None:
        group = getattr(self, "_pg", None)
        if group is None:  # closed meanwhile
            report(None)
            return
        # Keyed by c10d's group name: equal on every rank, and unique for the store's life.
        prefix = f"agang/census/{group.group_name}/{index}"
        _ = start_thread(
            lambda: report(self._absent_from_check(prefix)), name=f"census '{self.name}'"
        )

    def _absent_from_check(self, prefix: str) -> list[int] | None:
        """Says, through the store, that this rank is stuck at the check; returns the
        ranks that have not said so within ``_CENSUS_SECONDS``, or None if the store
        cannot tell."""
        keys = [f"{prefix}/{rank}" for rank in range(self.size)]
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(keys[self.rank], "1")
            give_up_at = time.monotonic() + _CENSUS_SECONDS
            while True:
                absent = [rank for rank, key in enumerate(keys) if not store.check([key])]
                if not absent or time.monotonic() >= give_up_at:
                    return absent
                time.sleep(0.01)
        except Exception:
            log.debug("The order-check census of gang '%s' failed.", self.name, exc_info=True)
            return None

    def _exchange_fingerprints(
        self, index: int, fingerprint: str, digests: list[int], checked: Checked
    ) -> None:
        prefix = f"agang/order/{self.name}/{index}"
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{prefix}/{self.rank}", fingerprint)
            texts: dict[int, str] = {}
            for digest in dict.fromkeys(digests):  # one rank per distinct fingerprint
                ranks = [r for r, d in enumerate(digests) if d == digest]
                key = f"{prefix}/{ranks[0]}"
                if self.rank in ranks:
                    text = fingerprint
                else:
                    if not self._await_key(store, key):
                        return  # the gang broke or closed meanwhile: nobody is waiting
                    text = store.get(key).decode()
                texts.update(dict.fromkeys(ranks, text))
        except Exception as exc:
            checked(None, exc)
            return
        checked(texts, None)

    def _await_key(self, store: Any, key: str) -> bool:
        # Not a blocking get: it holds the store client's lock while it waits, so two
        # exchanges at once (two mismatched positions, or two gangs) could deadlock
        # across ranks. Bounded by the backstop; the op's own deadline fires first.
        give_up = time.monotonic() + self._backstop
        while not store.check([key]):
            if self._broken is not None or self._closed or time.monotonic() > give_up:
                return False
            time.sleep(0.002)
        return True

    # Sub-gangs and lanes.

    @override
    async def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        members = check_member_ranks(ranks, self.size)
        child = await self._create_child(members, name=f"{self.name}{members}")
        if child is not None:
            with self._lock:
                self._children.append(child)
        return child

    @override
    async def _create_lane(self, name: str, *, high_priority: bool) -> ProcessGroupGang:
        lane = await self._create_child(
            list(range(self.size)), name=f"{self.name}/lane:{name}", high_priority=high_priority
        )
        assert lane is not None  # every rank is a member
        return lane

    async def _create_child(
        self, members: list[int], *, name: str, high_priority: bool = False
    ) -> ProcessGroupGang | None:
        self._check_usable()
        is_member = self.rank in members
        global_ranks = [dist.get_global_rank(self._pg, r) for r in members]
        backstop = timedelta(seconds=self._backstop)
        options: Any = None
        if high_priority and self._backend == "nccl":
            options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)

        def split() -> dist.ProcessGroup | None:
            # NCCL splits the parent's communicator (cheaper than a new one); every rank
            # of the parent takes part, and non-members get None.
            group: dist.ProcessGroup | None = dist.split_group(
                parent_pg=self._pg, split_ranks=[members], timeout=backstop, pg_options=options
            )
            return group

        def new_group(backend: str | None, pg_options: Any) -> dist.ProcessGroup | None:
            if self._is_world:
                # Every rank of the world takes part; non-members get a placeholder.
                group = dist.new_group(
                    global_ranks, timeout=backstop, backend=backend, pg_options=pg_options
                )
                return group if is_member else None
            if not is_member:
                return None
            local: dist.ProcessGroup = dist.new_group(
                global_ranks,
                timeout=backstop,
                backend=backend,
                pg_options=pg_options,
                use_local_synchronization=True,
            )
            return local

        def create() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
            if self._backend == "nccl" and hasattr(dist, "split_group"):
                group = split()
            else:
                group = new_group(None, options)
            side = new_group("gloo", None) if self._policy.check_order else None
            return group, side

        deadline = self._op_timeout
        stop_at = time.monotonic() + (deadline if deadline is not None else 1e9)

        def create_with_retry() -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
            # A store hiccup (connection refused or reset) is retried within the deadline.
            for attempt in retrying(RetryPolicy(), stop_at):
                with attempt:
                    groups = create()
            return groups

        try:
            made = await run_blocking(
                create_with_retry,
                name=f"create gang {members}",
                seconds=deadline,
                join_at_exit=False,
            )
        except Exception as exc:
            raise GangInitError(
                f"Creating a gang of ranks {members} of gang '{self.name}' failed: {exc}"
            ) from exc
        group, side = made if made is not None else (None, None)
        if group is None:
            if is_member:
                raise GangInitError(
                    f"Creating a gang of ranks {members} of gang '{self.name}' did not finish "
                    f"within {deadline} s; every rank of '{self.name}' must call create_gang "
                    f"(or lane) with the same ranks, in the same order."
                )
            return None
        child = ProcessGroupGang(
            group,
            device=self.device,
            backend=self.backend,
            name=name,
            policy=self._policy,
            is_world=False,
            stream_ordered=self._stream_ordered,
            order_group=side,
        )
        return child
