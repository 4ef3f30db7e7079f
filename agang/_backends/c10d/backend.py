"""The backend over a c10d process group: Gloo on CPU, NCCL on CUDA.

It implements the contract of ``agang._backends.contract``; ``agang.ProcessGroupGang``
is the gang over it. Each op starts here (its c10d call, in ``calls``) and hands its
Work to the backend's ``Completion``, which says how its end reaches agang, every way
(``completion``). On NCCL, c10d's barrier Work blocks the CPU in ``wait()`` until every
peer arrived, so the barrier is an all-reduce of one element instead, which completes
like any other op.

c10d's own timeout is a backstop behind agang's deadline: it is raised (``set_timeout``)
past the longest deadline asked for (``allow_timeout``), so c10d never fails an op
before agang would, and an op whose waiters are all gone still ends, and frees its
threads, eventually. A gang that breaks, or closes with work running, aborts its groups
(``abort``), which on Gloo too ends the running work at once.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import final

import torch
import torch.distributed as dist

from agang._backends.c10d import calls as c10d_calls
from agang._backends.c10d import mailbox
from agang._backends.c10d import order as c10d_order
from agang._backends.c10d import world as c10d_world
from agang._backends.c10d.abort import Aborter
from agang._backends.c10d.calls import (
    all_gather_flat,
    all_reduce_options,
    all_to_all_flat,
    divider,
    real,
    reduce_scatter_flat,
    then,
    to_c10d,
)
from agang._backends.c10d.children import create_groups
from agang._backends.c10d.completion import Completion
from agang._backends.contract import (
    Blamed,
    Checked,
    Done,
    Explanation,
    ProgressOf,
    holding,
)
from agang._backends.cuda.runtime import DeviceRuntime, StreamOrder, torch_runtime
from agang._errors import GangInitError
from agang._reduce_op import ReduceOp
from agang._runtime import loops, threads

log = logging.getLogger("agang.c10d")

# How long a release waits, after ending the work still running, for its ops' ends to
# be reported (so their memory is free once close returns); within close's own bound.
_REPORT_SECONDS = 2.0

# c10d's own timeout, kept behind agang's deadlines (``allow_timeout``): c10d fails an
# op, and on NCCL may end the process, when its process-group timeout passes, so the
# group's timeout sits this far behind the longest deadline asked for, and agang's
# deadline always fires first.
_BACKSTOP_FACTOR = 1.5
_BACKSTOP_MARGIN = 30.0
# Behind an op with no agang deadline, c10d's timeout must not fire either: when it does,
# NCCL's watchdog fails the op and signals every rank to dump its flight recorder, and
# the default group's heartbeat monitor then kills the process minutes later whatever
# the error handling mode. So "no deadline" lifts it to what is never reached in practice.
_NO_DEADLINE_BACKSTOP = 30 * 86400.0


def backstop_for(timeout: float | None) -> float:
    """The c10d timeout to use behind an agang deadline of ``timeout`` seconds (None: no
    deadline)."""
    if timeout is None:
        return _NO_DEADLINE_BACKSTOP
    return max(timeout * _BACKSTOP_FACTOR + _BACKSTOP_MARGIN, _BACKSTOP_MARGIN)


@final
class C10dBackend:
    """A c10d process group (and, with order checking, its side Gloo group).

    Args:
        process_group: The group the gang's ops run on.
        device: Where the ops' tensors live.
        kind: ``"gloo"`` or ``"nccl"``.
        name: The gang's name.
        is_world: Whether the group is the default (world) group.
        stream_ordered: NCCL: report an op done once it is ordered before later work on
            the caller's stream, not once it finished on the device.
        order_group: The side Gloo group of order checks, or None without them.
        runtime: The device runtime of the NCCL paths; None for torch.cuda.
        registered: Whether torch.distributed knows the group (it is destroyed through
            it at release); False for a group double, an epoch's group, or a private
            world (``is_world`` and registered nowhere: agang's world in a process
            whose default group, if any, is the user's).
        owned: Whether the gang owns the group and destroys it at release; False for a
            group borrowed from its owner (a ``DeviceMesh``'s), which destroys it itself.
        roster: Where each of the group's ranks runs, for a group outside the process's
            world (its ranks are not world ranks, so the world's roster would name other
            processes); None: the world's roster names them.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        device: torch.device,
        kind: str,
        name: str,
        is_world: bool,
        stream_ordered: bool = False,
        order_group: dist.ProcessGroup | None = None,
        runtime: DeviceRuntime | None = None,
        registered: bool = True,
        owned: bool = True,
        roster: Sequence[str] | None = None,
    ) -> None:
        self._pg: dist.ProcessGroup | None = process_group
        self._rank = process_group.rank()
        self._size = process_group.size()
        self._device = device
        self._kind = kind
        self._name = name
        self._order_group = order_group
        self._is_world = is_world
        self._stream_ordered = stream_ordered
        self._group_name = process_group.group_name
        self._backstop = 0.0
        self._stopped = False  # aborted or released: give up every wait of ours
        self._aborter = Aborter()
        # A simulated NCCL group (``agang._backends.sim_nccl``) brings its device's runtime.
        runtime = runtime or getattr(process_group, "agang_device_runtime", None)
        self._runtime: DeviceRuntime = torch_runtime() if runtime is None else runtime
        self._registered = registered
        # Blame is served by the groups c10d knows, and by a private world, whose ranks
        # are the process's world ranks all the same (its mailboxes are the world's).
        self._serves = registered or is_world
        self._progress: ProgressOf | None = None  # what this gang answers blames with
        self._deaths: Callable[[float], str] | None = None  # hear_deaths
        self._owned = owned
        self._roster = None if roster is None else list(roster)
        self._world_ranks = (
            c10d_world.world_ranks(process_group, registered and not is_world)
            if roster is None
            else []  # not world ranks: no world address or roster entry is theirs
        )
        self._completion = Completion(
            process_group,
            device=device,
            kind=kind,
            name=name,
            stream_ordered=stream_ordered,
            runtime=self._runtime,
        )
        # c10d copies the options on each call, so one object per op serves every call.
        self._all_reduce_options = {op: all_reduce_options(op, kind) for op in ReduceOp}
        # NCCL's ends are learned by asking (``completion``'s rule 3); Gloo reports its own.
        self.polls = kind == "nccl"
        # Asked at every issue and await: the completion's own method, one call less.
        self.poll = self._completion.poll  # type: ignore[method-assign]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def name(self) -> str:
        return self._name

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The c10d group, or None once released."""
        return self._pg

    # Learning of an end (``completion``'s rule 3).

    def poll(self) -> None:
        self._completion.poll()

    def park(self, issued_before: float = math.inf) -> float | None:
        return self._completion.park(issued_before)

    # Deadlines and deferred starts.

    def allow_timeout(self, seconds: float | None) -> None:
        backstop = backstop_for(seconds)
        if backstop <= self._backstop:
            return
        for group, _ in self._groups():  # none once released: the call is refused next
            group.set_timeout(timedelta(seconds=backstop))
        self._backstop = backstop

    def defer(self, start: Callable[[], None]) -> Callable[[], None]:
        if self._kind != "nccl" and self._device.type != "cuda":
            return start
        # A deferred op starts on a backend thread; order it after the work that was on
        # the caller's stream when it called, not after that thread's default stream.
        runtime = self._runtime
        stream = runtime.current_stream(self._device)

        def start_on_callers_stream() -> None:
            with runtime.use_stream(stream):
                start()

        return start_on_callers_stream

    def stream_order(self) -> StreamOrder | None:
        if self._kind != "nccl" and self._device.type != "cuda":
            return None
        return StreamOrder(self._runtime, self._device, stream_ordered=self._stream_ordered)

    def _group(self) -> dist.ProcessGroup:
        group = self._pg
        assert group is not None  # the engine starts nothing once the gang is closed
        return group

    # Collectives.

    def start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        options, divide = self._all_reduce_options[op]
        work = self._group().allreduce([real(tensor)], options)
        if divide:
            post = then(divider(tensor, self._size), post)
        self._completion.watch(work, done, post)

    def start_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, done: Done, *, to_host: bool = False
    ) -> None:
        # Gloo concatenates along the first dimension: the input must be flat like the
        # output, or a 2-D or 0-dim input fails ("invalid tensor size at index 0").
        flat_input = real(input.view(-1))
        work = all_gather_flat(self._group(), real(output), flat_input)
        self._completion.watch(work, done, to_host=to_host)

    def start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        work = self._group().allgather([[real(t) for t in outputs]], [real(input)])
        self._completion.watch(work, done)

    def start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        c10d_op, divide = to_c10d(op, backend=self._kind)
        work = reduce_scatter_flat(self._group(), real(output.view(-1)), real(input), c10d_op)
        self._completion.watch(work, done, divider(output, self._size) if divide else None)

    def start_broadcast(
        self, tensor: torch.Tensor, source_rank: int, done: Done, *, to_host: bool = False
    ) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = source_rank
        options.rootTensor = 0
        work = self._group().broadcast([real(tensor)], options)
        self._completion.watch(work, done, to_host=to_host)

    def start_all_gather_uneven(
        self, output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], done: Done
    ) -> None:
        group = self._group()
        work, repeated = c10d_calls.all_gather_uneven(group, real(output), real(input), split_sizes)
        self._completion.watch(work, holding(done, repeated))

    def start_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        done: Done,
        *,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        # Split sizes count rows (dim 0), which a complex tensor's real view keeps.
        splits = (output_split_sizes, input_split_sizes)
        work = all_to_all_flat(self._group(), real(output), real(input), *splits)
        self._completion.watch(work, done)

    # The rooted collectives: MEAN is divided on the destination only, where the sum is.

    def start_reduce(
        self, tensor: torch.Tensor, destination_rank: int, op: ReduceOp, done: Done
    ) -> None:
        c10d_op, divide = to_c10d(op, backend=self._kind)
        work = c10d_calls.reduce(self._group(), tensor, destination_rank, c10d_op)
        divide = divide and self._rank == destination_rank
        self._completion.watch(work, done, divider(tensor, self._size) if divide else None)

    def start_gather(
        self,
        outputs: list[torch.Tensor] | None,
        input: torch.Tensor,
        destination_rank: int,
        done: Done,
    ) -> None:
        work = c10d_calls.gather(self._group(), outputs, input, destination_rank)
        self._completion.watch(work, done)

    def start_scatter(
        self,
        output: torch.Tensor,
        inputs: list[torch.Tensor] | None,
        source_rank: int,
        done: Done,
    ) -> None:
        work = c10d_calls.scatter(self._group(), output, inputs, source_rank)
        self._completion.watch(work, done)

    def start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        self._completion.watch_p2p([self._group().send([real(tensor)], destination_rank, 0)], done)

    def start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        self._completion.watch_p2p([self._group().recv([real(tensor)], source_rank, 0)], done)

    def start_exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        done: Done,
    ) -> None:
        # NCCL: one coalesced group, one Work (batch_isend_irecv's path); Gloo cannot
        # coalesce: one Work per transfer, the batch done once all are.
        device = self._device if self._kind == "nccl" else None
        works = c10d_calls.exchange(self._group(), sends, recvs, device)
        self._completion.watch_p2p(works, done)

    def start_barrier(self, done: Done) -> None:
        if self._kind == "nccl":
            # The one-element tensor lives until the op's end: ``done`` holds it.
            token = torch.zeros(1, device=self._device)
            options, _ = self._all_reduce_options[ReduceOp.SUM]
            work = self._group().allreduce([token], options)
            self._completion.watch(work, holding(done, token))
            return
        self._completion.watch(self._group().barrier(dist.BarrierOptions()), done)

    # Order checking (``order``).

    def start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        assert self._order_group is not None  # the policy checks order: the gang made it
        c10d_order.start_order_check(
            self._order_group,
            rank=self._rank,
            size=self._size,
            name=self._name,
            index=index,
            fingerprint=fingerprint,
            checked=checked,
            give_up=lambda: self._stopped,
        )

    # Blame (``mailbox``).

    def serve_progress(self, progress: ProgressOf) -> None:
        if self._serves:
            self._progress = progress
            mailbox.serve(self._group_name, self._rank, progress)

    def start_blame(self, number: int, report: Blamed, *, collective: bool = False) -> None:
        if self._stopped or not self._serves:
            return report(None, "the gang's communicator is released")
        peers = {r: world for r, world in enumerate(self._world_ranks) if r != self._rank}
        mailbox.start_blame(self._group_name, number, peers, report, collective=collective)

    def where(self, rank: int) -> str:
        if self._roster is not None:
            known = 0 <= rank < len(self._roster) and self._roster[rank]
            return f"rank {rank} ({self._roster[rank]})" if known else f"rank {rank}"
        return c10d_world.where(self._world_ranks, rank)

    def hear_deaths(self, heard: Callable[[float], str]) -> None:
        """Has ``explain`` ask ``heard(seconds)`` what a watcher reported of a dead peer
        (a death notice, waited for up to ``seconds``: a watcher's word and the lost
        connection come tens of milliseconds apart, in either order); "" for nothing."""
        self._deaths = heard

    def explain(self, error: BaseException) -> Explanation:
        deaths = self._deaths
        if deaths is not None and _LOST.search(str(error)):
            off_loop = loops.current_library() is None
            reported = deaths(DEATH_NOTICE_SECONDS if off_loop else 0.0)
            if reported:
                return Explanation(reported=reported)
        lost = c10d_world.lost_peer(error, self._world_ranks, self._rank, self.where)
        # A peer that gave up at its deadline said so before its abort dropped the
        # connection (mailbox rule 8); off the loop, its letter may be waited for.
        wait = mailbox.NOTICE_SECONDS if lost and loops.current_library() is None else 0.0
        told = mailbox.notices(self._group_name, wait) if self._serves else {}
        said = "; and ".join(
            f"{self.where(rank)} gave up first: {message.rstrip('.')}"
            for rank, message in sorted(told.items())
            if rank != self._rank
        )
        return Explanation(gave_up=said, lost=lost)

    # Failure and lifecycle.

    def _bind(self) -> None:
        """Makes the gang's GPU this thread's device before it touches CUDA (agang's own
        threads start on GPU 0, where a CUDA call would make a context of its own)."""
        if self._kind == "nccl":
            self._runtime.bind_thread(self._device)

    def abort(self, reason: str | None = None) -> None:
        self._stopped = True
        # An abort can take a moment; never on the caller's thread (maybe the loop's, or
        # one of c10d's own, where a failed op's callback breaks the gang). The groups are
        # taken on the abort's thread, not here: a release on another thread drops the
        # backend's references (see ``release``), and a reference held on c10d's worker
        # thread could then be the last, whose destructor joins that very thread and
        # aborts the process (a CI run's whole-server subscriber died so: SIGABRT in a
        # Gloo callback, as its failed epoch's group was closed beside it).
        if self._pg is not None or self._order_group is not None:
            told = reason is not None and self._serves
            peers = {r: w for r, w in enumerate(self._world_ranks) if r != self._rank}

            def abort_groups() -> None:
                groups = self._groups()
                if not groups:  # a release on another thread has freed them already
                    return
                if told and reason is not None:  # before the connections drop (mailbox rule 8)
                    try:
                        mailbox.tell_gave_up(self._group_name, self._rank, peers, reason)
                    except Exception:
                        log.debug("agang: the peers could not be told.", exc_info=True)
                self._bind()
                self._aborter.abort(groups)

            threads.start_daemon(abort_groups, name=f"agang: abort gang '{self._name}'")
        self._completion.park()  # the aborted ops end soon: their ``done`` must come

    def _groups(self) -> list[tuple[dist.ProcessGroup, str]]:
        """The groups and their backends, while the backend holds them."""
        group, order_group = self._pg, self._order_group
        groups = [] if group is None else [(group, self._kind)]
        if order_group is not None:
            groups.append((order_group, "gloo"))
        return groups

    def release(self, *, unfinished: bool) -> None:
        self._bind()  # runs on a closing thread of agang's, or the caller's
        self._stopped = True
        self._completion.release()
        if self._serves:
            mailbox.unserve(
                self._group_name,
                self._progress,
                world=self._is_world,
                hosts_store=self._is_world and c10d_world.current().hosts_store,
            )
        try:
            if unfinished:
                # Work still running would make destroy (NCCL) or the group's destructor
                # (Gloo) wait for it, for ever if the peer is hung: end it first (or let
                # the abort that a failure started end it).
                self._aborter.abort(self._groups())
                self._completion.settle_after_abort(self._name, _REPORT_SECONDS)
            side = self._order_group
            if side is not None and _still_registered(side):
                # Not there: the world went first, as for the main group below.
                try:
                    dist.destroy_process_group(side)
                except Exception:  # the main group is still released
                    log.warning(
                        "Releasing the order-check group of gang '%s' failed.",
                        self._name,
                        exc_info=True,
                    )
            if not self._owned:
                pass  # a borrowed group: not ours to destroy
            elif not self._registered:
                if self._kind == "nccl" and self._pg is not None:
                    # An NCCL group of agang's own registered nowhere (an epoch's): its
                    # communicator shut down as destroy would. NCCL's destructor would
                    # warn; a simulated one's wire would stay open, its threads alive.
                    self._pg.shutdown()
            elif self._is_world:
                dist.destroy_process_group()
            elif self._pg is not None and _still_registered(self._pg):
                # Not there: the world went first (a child made while its parent closed).
                dist.destroy_process_group(self._pg)
        except Exception:
            log.warning(
                "Releasing the process group of gang '%s' failed.", self._name, exc_info=True
            )
        # Drop our reference here, on the closing thread (with no work left running, the
        # destructor returns at once). Completion callbacks hold the backend and are
        # freed on c10d's threads; if the backend still held the group then, its
        # destructor could run on its own worker thread and abort the process
        # ("Resource deadlock avoided": a thread joining itself).
        self._pg = None
        self._order_group = None

    async def create_child(
        self, members: list[int], *, name: str, high_priority: bool, seconds: float | None
    ) -> C10dBackend | None:
        if self._is_world and not self._registered:
            raise GangInitError(
                f"Gang '{self._name}' is a private world (registered nowhere in "
                f"torch.distributed, as agang.ray makes it), and c10d makes sub-groups only "
                f"of its default group: it has no sub-gangs. Form another gang of the "
                f"members instead."
            )
        group, side = await create_groups(
            self._group(),
            members,
            kind=self._kind,
            is_world=self._is_world,
            with_side_group=self._order_group is not None,
            high_priority=high_priority,
            backstop=self._backstop,
            seconds=seconds,
            parent_name=self._name,
            name=name,
            bind=self._bind,
            device=self._device,
        )
        if group is None:
            return None
        return C10dBackend(
            group,
            device=self._device,
            kind=self._kind,
            name=name,
            is_world=False,
            stream_ordered=self._stream_ordered,
            order_group=side,
            runtime=self._runtime,
        )


#: The most a failed op waits for a watcher's death notice of the peer its transport
#: lost (``hear_deaths``; seconds): Ray's comes within about 20 ms of a kill here.
DEATH_NOTICE_SECONDS = 0.25
#: A transport's words for a lost peer (Gloo's, the simulated NCCL's).
_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|connection|peer|abort", re.I)


def _still_registered(group: dist.ProcessGroup) -> bool:
    """Whether c10d still knows ``group``: a child made while its parent closed is
    dropped from c10d's registry when the world goes, and destroying it again raises."""
    return group in dist.distributed_c10d._world.pg_map
