"""Making this process's gang: ``await agang.init()`` and ``agang.init_sync()``.

Rules:
1. The world comes from ``world=``, else the launcher's environment (torchrun, then
   SLURM); none, or a world of size 1, gives an in-process gang with no network.
2. The whole set-up (store, check-in, process group, a proving barrier) runs on a daemon
   thread under one deadline. The caller's loop keeps serving meanwhile; a cancelled
   init returns at once and the thread winds down within a wait slice, tearing down
   whatever it had built; a daemon thread can never keep the process from exiting.
3. Transient failures are retried (``agang._backends.c10d.retry``); a deadline names the
   missing ranks (``agang._setup.rendezvous``). Every error is a ``GangInitError``
   with the store address, the attempts, the elapsed time and the likely causes.
4. Before the group is made, the process is prepared (``agang._setup.process``: the
   network interface, NCCL's settings, the CPU share); every setting made is logged.
5. On CUDA, the gang's device becomes the calling thread's current device before
   ``init`` returns (CUDA keeps one per host thread, and set-up ran on its own).
6. One gang from init per process: while one is open, a second init raises
   ``GangInitError`` naming it (a second gang over one communicator would number its
   ops apart, and outlive the group the first destroys). An in-process gang counts too,
   so a program behaves the same run as one process as under torchrun.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist

from agang._backends.c10d import world as c10d_world
from agang._backends.c10d.calls import connect_eagerly
from agang._backends.c10d.retry import PortInUseError, RetryPolicy, TransientSetupError, call_c10d
from agang._collective.fake_gang import FakeGang
from agang._collective.process_group_gang import ProcessGroupGang, check_no_open_world
from agang._errors import GangInitError
from agang._gang import Gang
from agang._policy import (
    CHECKS_ORDER_BY_DEFAULT,
    CheckOrder,
    GangPolicy,
    InFlightLimits,
    OnTimeout,
    make_policy,
    order_check_defaulted,
)
from agang._runtime.future import Future
from agang._runtime.threads import start_thread
from agang._setup import simulation
from agang._setup.elastic import Elastic
from agang._setup.elastic_gang import form_first
from agang._setup.env import WorldInfo, world_from_env
from agang._setup.interface import own_link
from agang._setup.process import prepare_process, resolve_backend, resolve_device
from agang._setup.rendezvous import (
    InitCancelled,
    Member,
    check_in,
    clear_frames,
    end_round,
    open_store,
    prove,
)
from agang._validate import check_deadline

log = logging.getLogger("agang.setup")

#: The deadline of the whole set-up where ``init`` is given ``timeout=None`` (the default).
DEFAULT_INIT_TIMEOUT = 300.0
# The proving barrier after construction: every rank already checked in, so it is quick.
# How long past the deadline the caller waits for the thread's own, more precise, error.
_REPORT_GRACE = 2.0
# Calls to init in this process: part of the store prefix, so re-inits never collide.
_init_calls = itertools.count()

_LIKELY_CAUSES = (
    "a rank was not started or crashed; MASTER_ADDR/MASTER_PORT differ between ranks; "
    "a firewall blocks the port (run `agang doctor` on each node)"
)


#: The in-process gangs init made, while open: a second init is refused meanwhile, on
#: both paths alike (rule 6).
_open_local_gangs: list[Gang] = []


def _check_no_open_gang() -> None:
    """Raises ``GangInitError`` naming the gang an earlier init made, if it is still open:
    the world gang (c10d), or an in-process one. One process has one gang from init at a
    time, whichever path made it, so a program behaves the same under torchrun as run
    as one process."""
    check_no_open_world()
    for gang in _open_local_gangs:
        if not gang.closed:
            raise GangInitError(
                f"agang.init() was called while the world gang '{gang.name}' (rank "
                f"{gang.rank} of {gang.size}, in-process) is still open: one process has "
                "one world gang. Close it first, or keep using it."
            )


class _Plan:
    """Everything init decided before touching the network, and the set-up itself."""

    def __init__(
        self,
        *,
        backend: str | None,
        device: object,
        timeout: float | None,
        policy: GangPolicy,
        env: Mapping[str, str] | None,
        world: WorldInfo | None,
        in_process: bool | None,
        stream_ordered: bool,
        retry: RetryPolicy | None,
    ) -> None:
        self.timeout = check_deadline(timeout, name="timeout", default=DEFAULT_INIT_TIMEOUT)
        self.policy = policy
        self.op_timeout = self.policy.op_timeout
        if world is not None and not isinstance(world, WorldInfo):
            raise TypeError(
                f"`world` must be an agang.WorldInfo or None, but is {world!r} instead."
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(
                f"`retry` must be an agang.RetryPolicy or None, but is {retry!r} instead."
            )
        if in_process is not None and not isinstance(in_process, bool):
            raise TypeError(f"`in_process` must be a bool or None, but is {in_process!r} instead.")
        self.env = os.environ if env is None else env
        self.world = world if world is not None else world_from_env(self.env)
        simulated = simulation.install_if_requested(self.env) or simulation.world_is_simulated()
        self.device = resolve_device(device, backend, self.world)
        self.backend = resolve_backend(backend, self.device, simulated=simulated)
        single = self.world is None or self.world.world_size == 1
        self.in_process = single if in_process is None else in_process
        if not self.in_process and self.world is None:
            self.world = WorldInfo(0, 1, 0, "127.0.0.1", 0, source="arguments")
        self.stream_ordered = stream_ordered
        self.elastic: Elastic | None = None
        self.retry = retry or RetryPolicy()
        self.cancelled = threading.Event()
        self.started = time.monotonic()
        self.attempts = 0
        self.last_missing: tuple[int, ...] = ()  # as the store host last reported them
        self.members: list[Member] = []  # as they checked in, at the last attempt
        # A store the launcher keeps across inits (torchrun's agent, which restarts all
        # ranks together) holds earlier inits' keys: count inits into the prefix. A store
        # rank 0 hosts is new at every attempt, so ranks with different histories (a
        # re-init beside a late first init) still meet.
        restart = self.env.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"agang/init/{restart}"
        if self.world is not None and self.world.launcher_hosts_store:
            self.prefix += f".{next(_init_calls)}"

    @property
    def deadline_seconds(self) -> float:
        return math.inf if self.timeout is None else self.timeout

    def local_gang(self) -> Gang:
        _check_no_open_gang()  # as on the c10d path (rule 6)
        log.info("agang: no multi-rank world in the environment; using an in-process gang.")
        self._bind_caller()
        gang = FakeGang(rank=0, size=1, device=self.device, policy=self.policy)
        _open_local_gangs[:] = [g for g in _open_local_gangs if not g.closed]
        _open_local_gangs.append(gang)
        return gang

    def connect(self) -> ProcessGroupGang:
        """The blocking part (rule 2). Runs on a daemon thread."""
        world = self.world
        assert world is not None
        prepare_process(world, self.backend, self.device, self.env)
        started = time.monotonic()
        deadline = started + min(self.deadline_seconds, 10 * 365 * 86400.0)
        if self.elastic is not None:
            return form_first(self, world, self.elastic, deadline)
        created = not dist.is_initialized()
        if created:
            self._make_group(world, deadline)
            prove(deadline)
        else:
            log.info("agang: torch.distributed is already initialized; wrapping its world.")
            c10d_world.forget()
            if self.device.type == "cuda":  # here, not at the first op on the caller's loop
                connect_eagerly(dist.distributed_c10d._get_default_group(), self.device)
        order_group = None
        try:
            if self.policy.check_order:
                # The side channel of order checks: a Gloo group over the world, so a
                # check never queues behind the ops it guards.
                seconds = max(1.0, deadline - time.monotonic())
                order_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
            if self.cancelled.is_set():
                raise InitCancelled
        except BaseException:
            # A peer lost while the side group forms, or a cancel: nothing made here is
            # left behind, so a retry starts from nothing (not a half-made world).
            try:
                if order_group is not None:
                    dist.destroy_process_group(order_group)
            except Exception:  # the error being raised is the one to tell
                log.debug("agang: the side group could not be destroyed.", exc_info=True)
            if created:
                dist.destroy_process_group()
            raise
        return ProcessGroupGang(
            dist.distributed_c10d._get_default_group(),
            device=self.device,
            backend=self.backend,
            name="root",
            policy=self.policy,
            is_world=True,
            stream_ordered=self.stream_ordered,
            order_group=order_group,
        )

    def _count_attempt(self) -> None:
        self.attempts += 1

    def _note_missing(self, missing: list[int]) -> None:
        self.last_missing = tuple(missing)

    def _check_in(self, store: Any, world: WorldInfo, deadline: float) -> None:
        link = own_link(world.master_addr, os.environ)
        self.members = check_in(
            store,
            world,
            self.prefix,
            deadline=deadline,
            cancelled=self.cancelled,
            on_missing=self._note_missing,
            link=link,
            settings={
                "check_order": str(self.policy.check_order),
                "backend": simulation.check_in_name(self.backend, self.device),
            },
        )

    def _make_group(self, world: WorldInfo, deadline: float) -> None:
        try:
            store, port = open_store(
                world,
                deadline=deadline,
                policy=self.retry,
                cancelled=self.cancelled,
                on_attempt=self._count_attempt,
                then=lambda store: self._check_in(store, world, deadline),
            )
            # What the c10d backend names ranks, lost peers and the store with.
            c10d_world.publish(
                c10d_world.World(
                    roster=tuple(member.describe() for member in self.members),
                    addresses=tuple(member.link.address for member in self.members),
                    store_address=f"{world.master_addr}:{port}",
                    hosts_store=world.rank == 0 and not world.launcher_hosts_store,
                )
            )
            if port != world.master_port:
                log.info(
                    "agang: port %d was taken; the store is on port %d.", world.master_port, port
                )
            call_c10d(
                dist.init_process_group,
                simulation.c10d_name(self.backend, self.device),
                store=dist.PrefixStore(f"{self.prefix}/pg", store),  # type: ignore[attr-defined]
                rank=world.rank,
                world_size=world.world_size,
                timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
                device_id=self.device if self.device.type == "cuda" else None,
            )
            end_round(store, world, self.prefix)
        except BaseException as error:
            # A failure's traceback keeps its frames' locals, and so a hosted store and its
            # port, alive for as long as the caller keeps the error: drop them, along the
            # chain of causes too (a transient error's cause was raised deeper). A re-init
            # on the same port would otherwise find it in use.
            clear_frames(error)
            raise
        finally:
            store = None  # on success the group holds its own reference

    def failed(self, error: BaseException | None, elapsed: float) -> GangInitError:
        world = self.world
        assert world is not None
        address = world.store_address
        missing: tuple[int, ...] = ()
        if isinstance(error, GangInitError) and error.missing_ranks:
            missing = error.missing_ranks
        # The cause's own sentence ends where the figures in brackets follow it.
        cause = "did not finish" if error is None else f"failed: {str(error).rstrip('. ')}"
        # Attempts are counted where agang opens the store itself (not on an elastic
        # formation's own connections): "0 attempts" would say nothing true.
        attempts = f"{self.attempts} attempt(s), " if self.attempts else ""
        message = (
            f"Setting up rank {world.rank} of {world.world_size} ({self.backend}, store "
            f"{address}, from {_origin(world)}) {cause} (after {elapsed:.1f} s, "
            f"{attempts}deadline {self.timeout} s)."
        )
        if not missing and self.last_missing:
            missing = self.last_missing
            message += " The store host gave up earlier, when ranks were missing."
        if missing:
            message += f" Missing ranks: {list(missing)}."
        # agang's own diagnosis (a duplicate RANK, settings that differ, a lost elastic
        # job, a joiner beyond max_size) says what is wrong: guesses would only blur it.
        diagnosed = isinstance(error, GangInitError) and not missing
        if not isinstance(error, PortInUseError) and not diagnosed:
            message += f" Likely causes: {_LIKELY_CAUSES}."
        return GangInitError(
            message,
            missing_ranks=missing,
            store_address=address,
            attempts=self.attempts,
            elapsed=elapsed,
        )

    def report(self, error: BaseException | None) -> GangInitError:
        """The error init raises for ``error`` (None: the wait ran out), with ``error``,
        or c10d's own error behind a transient one, as its ``__cause__``."""
        if isinstance(error, TransientSetupError) and error.__cause__ is not None:
            error = error.__cause__
        failure = self.failed(error, time.monotonic() - self.started)
        if error is not None:
            failure.__cause__ = error
        return failure

    def up(self, gang: ProcessGroupGang) -> ProcessGroupGang:
        """The gang, handed over on the caller's thread (rule 5)."""
        self._bind_caller()
        log.info("agang: %r is up after %.2f s.", gang, time.monotonic() - self.started)
        return gang

    def _bind_caller(self) -> None:
        # CUDA's current device is per host thread, and set-up ran on another one: the
        # caller was still on GPU 0, where its own tensors and streams would then go.
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)


def _origin(world: WorldInfo) -> str:
    """Where the world's settings came from, for a message: torchrun's variables set by
    hand are not torchrun (torchrun always sets ``TORCHELASTIC_RUN_ID``)."""
    if world.source == "torchrun" and not world.job_id:
        return "RANK/WORLD_SIZE variables"
    return world.source


def _start(
    *,
    backend: str | None,
    device: torch.device | str | None,
    timeout: float | None,
    op_timeout: float | None,
    env: Mapping[str, str] | None,
    world: WorldInfo | None,
    in_process: bool | None,
    stream_ordered: bool,
    retry: RetryPolicy | None,
    on_timeout: OnTimeout,
    limits: InFlightLimits | None,
    check_order: CheckOrder | None,
    elastic: Elastic | None = None,
) -> tuple[_Plan, Future[ProcessGroupGang] | None]:
    """The body [`init`][agang.init] and [`init_sync`][agang.init_sync] share: checks the arguments,
    plans, and starts the set-up thread. No handle means an in-process gang (``plan.local_gang()``);
    only how the caller waits for the handle differs."""
    check_deadline(timeout, name="timeout", default=None)  # refused first; the plan keeps it
    policy = make_policy(
        op_timeout=op_timeout,
        on_timeout=on_timeout,
        limits=limits,
        check_order=check_order,
        env=None if env is None else dict(env),
    )
    plan = _Plan(
        backend=backend,
        device=device,
        timeout=timeout,
        policy=policy,
        env=env,
        world=world,
        in_process=in_process,
        stream_ordered=stream_ordered,
        retry=retry,
    )
    if elastic is not None and not isinstance(elastic, Elastic):
        raise TypeError(f"`elastic` must be an agang.Elastic or None, but is {elastic!r}.")
    if order_check_defaulted(check_order, env) and (elastic is not None or not plan.in_process):
        # Checked by default where a mismatch would kill a process (``_policy``). An
        # elastic gang is always c10d's, whatever WORLD_SIZE says (its founder may be
        # alone, its joiners not): every member must decide alike.
        on = plan.backend in CHECKS_ORDER_BY_DEFAULT
        plan.policy = dataclasses.replace(plan.policy, check_order=on)
    plan.elastic = elastic
    if elastic is not None and plan.world is None:
        raise GangInitError(
            "An elastic gang needs MASTER_ADDR and MASTER_PORT (an `agang store`), RANK and "
            "WORLD_SIZE in the environment, or `world`."
        )
    if plan.in_process and elastic is None:
        return plan, None
    _check_no_open_gang()  # rule 6: before anything touches the network
    plan.started = time.monotonic()
    return plan, start_thread(plan.connect, name="init")  # joined at exit: _runtime.threads


async def init(
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    # A deadline on the whole set-up is part of init's contract, so it is an argument
    # of the coroutine (not a cancel scope around it, which ASYNC109 would suggest).
    timeout: float | None = None,  # noqa: ASYNC109
    op_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    world: WorldInfo | None = None,
    in_process: bool | None = None,
    stream_ordered: bool = False,
    retry: RetryPolicy | None = None,
    on_timeout: OnTimeout = "abort",
    limits: InFlightLimits | None = None,
    check_order: CheckOrder | None = None,
    elastic: Elastic | None = None,
) -> Gang:
    """Makes the gang of this process's world.

    The world comes from ``world``, else torchrun's variables, else SLURM's. With a
    world above size 1, a Gloo (CPU) or NCCL (CUDA) process group is set up off the loop,
    retried on transient errors, and proven by a barrier, all within ``timeout``. With
    no world, or a world of size 1, it returns an in-process gang with no network.

    Cancelling the awaiting task stops the wait at once; the set-up thread then winds
    down and releases what it had built.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or None to pick from the device.
        device: The gang's device; None for ``cuda:LOCAL_RANK`` if CUDA is there, else CPU.
        timeout: Seconds the whole set-up may take: None for the default (300 s),
            ``math.inf`` for no deadline.
        op_timeout: The deadline of every op of the gang called without one: None for
            the default (300 s), ``math.inf`` for none.
        env: The environment to read instead of ``os.environ`` (for tests).
        world: The world, given explicitly instead of read from the environment.
        in_process: Force (True) or refuse (False) the in-process gang; None decides by
            world size.
        stream_ordered: NCCL only: ``await`` returns once the op is ordered before later
            work on the current stream, instead of once it finished on the device.
        retry: How to retry transient failures; the default backs off exponentially with
            jitter until the deadline.
        on_timeout: What a missed op deadline does: ``"abort"`` (default) aborts the
            communicator, breaks the gang and fails every pending op with the cause;
            ``"raise"`` fails only that op, whose tensors stay busy until c10d ends it.
        limits: The in-flight bounds and what a call does past them
            ([`agang.InFlightLimits`][agang.InFlightLimits]); None for 1,024 ops and 1 GiB, queued.
        check_order: Compare every collective's fingerprint (op, shapes, dtypes, reduce
            op, root) across ranks before starting it, and raise
            [`agang.CollectiveMismatchError`][agang.CollectiveMismatchError] on every
            rank on a mismatch;
            ``"call_site"`` adds the issuing line (tells swapped equal ops apart). None
            reads ``AGANG_CHECK_ORDER`` (``1``, ``0`` or ``call_site``), and where that
            is unset checks on Gloo (where a mismatch kills a process) and not on NCCL
            or in process; equal on every rank.
        elastic: Form an elastic gang ([`agang.Elastic`][agang.Elastic]) on the store at
            ``MASTER_ADDR:MASTER_PORT``, which no rank hosts (``agang store``).

    Returns:
        The root gang (an elastic one, with ``epoch`` and ``reform()``, with ``elastic``).

    Raises:
        GangInitError: The environment is invalid, a permanent error occurred, the
            deadline passed (``missing_ranks`` names who never checked in), or this
            process's world gang is still open (close it first, or keep using it).
        ValueError: An argument is invalid; the message names it.

    Example:
        <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
        ```python
        gang = await agang.init(timeout=60)
        await gang.all_reduce(torch.ones(1))
        ```
    """
    plan, handle = _start(
        backend=backend,
        device=device,
        timeout=timeout,
        op_timeout=op_timeout,
        env=env,
        world=world,
        in_process=in_process,
        stream_ordered=stream_ordered,
        retry=retry,
        on_timeout=on_timeout,
        limits=limits,
        check_order=check_order,
        elastic=elastic,
    )
    if handle is None:
        return plan.local_gang()
    finished = False
    try:
        gang = await _await_within(handle, plan.deadline_seconds + _REPORT_GRACE)
        finished = True
    except Exception as error:
        failure = plan.report(error)
        raise failure from failure.__cause__
    finally:
        if not finished:
            plan.cancelled.set()
    if gang is None:
        raise plan.report(None)
    return plan.up(gang)


async def _await_within(
    handle: Future[ProcessGroupGang], seconds: float
) -> ProcessGroupGang | None:
    with anyio.move_on_after(seconds):
        return await handle
    return None


def init_sync(
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = None,
    op_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    world: WorldInfo | None = None,
    in_process: bool | None = None,
    stream_ordered: bool = False,
    retry: RetryPolicy | None = None,
    on_timeout: OnTimeout = "abort",
    limits: InFlightLimits | None = None,
    check_order: CheckOrder | None = None,
    elastic: Elastic | None = None,
) -> Gang:
    """[`init`][agang.init] for programs without an event loop; blocks at most ``timeout`` seconds.

    Example:
        <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
        ```python
        gang = agang.init_sync()
        gang.all_reduce(torch.ones(1)).wait()
        ```
    """
    plan, handle = _start(
        backend=backend,
        device=device,
        timeout=timeout,
        op_timeout=op_timeout,
        env=env,
        world=world,
        in_process=in_process,
        stream_ordered=stream_ordered,
        retry=retry,
        on_timeout=on_timeout,
        limits=limits,
        check_order=check_order,
        elastic=elastic,
    )
    if handle is None:
        return plan.local_gang()
    seconds = plan.deadline_seconds + _REPORT_GRACE
    try:
        gang = handle.wait(None if math.isinf(seconds) else seconds)
    except Exception as error:
        if not handle.done():  # our wait gave up, not the set-up
            plan.cancelled.set()
            raise plan.report(None) from None
        failure = plan.report(error)
        raise failure from failure.__cause__
    return plan.up(gang)
