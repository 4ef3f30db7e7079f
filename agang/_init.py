"""Making this process's gang: ``await agang.init()`` and ``agang.init_sync()``.

The blocking c10d set-up (store connection, process-group construction) runs on a
daemon thread under one deadline, so the caller's loop keeps serving while peers are
late, a cancelled init returns at once, and a stuck c10d call cannot keep the process
from exiting; c10d is given the same deadline, so the thread ends on its own too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from agang._env import WorldInfo, world_from_env
from agang._errors import GangInitError
from agang._fake_gang import FakeGang
from agang._gang import Gang
from agang._offload import run_blocking, start_thread
from agang._process_group_gang import ProcessGroupGang, backstop_for
from agang._validate import check_timeout

log = logging.getLogger("agang")

DEFAULT_INIT_TIMEOUT = 300.0
DEFAULT_OP_TIMEOUT = 300.0


def _resolve_device(device: object, backend: str | None, world: WorldInfo | None) -> torch.device:
    if device is not None:
        try:
            return torch.device(device)  # type: ignore[call-overload,no-any-return]
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"`device` must be a torch.device or a device string, but is {device!r} instead."
            ) from exc
    if backend != "gloo" and torch.cuda.is_available():
        local_rank = world.local_rank if world is not None else 0
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _resolve_backend(backend: object, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"`backend` must be 'gloo', 'nccl' or None, but is {backend!r} instead.")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"`device` must be a CUDA device for the 'nccl' backend, but is {device} instead."
        )
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(
            f"`device` must be the CPU for the 'gloo' backend, but is {device} instead."
        )
    return str(backend)


class _Plan:
    """Everything init decided before touching the network."""

    def __init__(
        self,
        *,
        backend: str | None,
        device: object,
        timeout: float | None,
        op_timeout: float | None,
        env: Mapping[str, str] | None,
        in_process: bool | None,
        stream_ordered: bool,
    ) -> None:
        self.timeout = check_timeout(timeout)
        self.op_timeout = check_timeout(op_timeout, name="op_timeout")
        self.world = world_from_env(os.environ if env is None else env)
        self.device = _resolve_device(device, backend, self.world)
        self.backend = _resolve_backend(backend, self.device)
        if in_process is not None and not isinstance(in_process, bool):
            raise TypeError(f"`in_process` must be a bool or None, but is {in_process!r} instead.")
        single = self.world is None or self.world.world_size == 1
        self.in_process = single if in_process is None else in_process
        if not self.in_process and self.world is None:
            self.world = WorldInfo(0, 1, 0, "127.0.0.1", 0, source="arguments")
        self.stream_ordered = stream_ordered

    def local_gang(self) -> Gang:
        log.info("agang: no multi-rank world in the environment; using an in-process gang.")
        return FakeGang(rank=0, size=1, device=self.device, op_timeout=self.op_timeout)

    def connect(self) -> ProcessGroupGang:
        """The blocking part: store, process group, gang. Runs off the loop."""
        world = self.world
        assert world is not None
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            log.info("agang: torch.distributed is already initialized; wrapping its world.")
        else:
            deadline = timedelta(seconds=self.timeout if self.timeout is not None else 1800.0)
            is_host = world.rank == 0 and not world.launcher_hosts_store
            store = dist.TCPStore(  # type: ignore[attr-defined]
                world.master_addr,
                world.master_port,
                world.world_size,
                is_master=is_host,
                timeout=deadline,
                wait_for_workers=False,
            )
            dist.init_process_group(
                self.backend,
                store=store,
                rank=world.rank,
                world_size=world.world_size,
                timeout=timedelta(seconds=backstop_for(self.op_timeout)),
                device_id=self.device if self.backend == "nccl" else None,
            )
        group = dist.distributed_c10d._get_default_group()
        return ProcessGroupGang(
            group,
            device=self.device,
            backend=self.backend,
            name="root",
            op_timeout=self.op_timeout,
            is_world=True,
            stream_ordered=self.stream_ordered,
        )

    def failed(self, error: BaseException | None, elapsed: float) -> GangInitError:
        world = self.world
        assert world is not None
        address = world.store_address
        cause = "did not finish" if error is None else f"failed: {error}"
        return GangInitError(
            f"Setting up rank {world.rank} of {world.world_size} ({self.backend}, store "
            f"{address}) {cause} after {elapsed:.1f} s (deadline {self.timeout} s). Check "
            f"that every rank was started and that MASTER_ADDR/MASTER_PORT agree and are "
            f"reachable.",
            store_address=address,
            elapsed=elapsed,
        )


async def init(
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    # The design makes init's deadline an argument (design.md section 6).
    timeout: float | None = DEFAULT_INIT_TIMEOUT,  # noqa: ASYNC109
    op_timeout: float | None = DEFAULT_OP_TIMEOUT,
    env: Mapping[str, str] | None = None,
    in_process: bool | None = None,
    stream_ordered: bool = False,
) -> Gang:
    """Makes the gang of this process's world, from its launcher's environment.

    With torchrun's variables and a world size above 1, a Gloo (CPU) or NCCL (CUDA)
    process group is set up, off the loop, under ``timeout``. With no variables, or a
    world of size 1, it returns an in-process gang with no network.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or None to pick from the device.
        device: The gang's device; None for ``cuda:LOCAL_RANK`` if CUDA is there, else CPU.
        timeout: Seconds the whole set-up may take; None for no deadline.
        op_timeout: The default deadline of every op of the gang; None for none.
        env: The environment to read instead of ``os.environ`` (for tests).
        in_process: Force (True) or refuse (False) the in-process gang; None decides by
            world size.
        stream_ordered: NCCL only: ``await`` returns once the op is ordered before later
            work on the current stream, instead of once it finished on the device.

    Returns:
        The root gang.

    Raises:
        GangInitError: The environment is invalid, or set-up failed or missed its deadline.
        ValueError: An argument is invalid; the message names it.

    Example:
        >>> gang = await agang.init()
        >>> await gang.all_reduce(torch.ones(1))
    """
    plan = _Plan(
        backend=backend,
        device=device,
        timeout=timeout,
        op_timeout=op_timeout,
        env=env,
        in_process=in_process,
        stream_ordered=stream_ordered,
    )
    if plan.in_process:
        return plan.local_gang()
    started = time.monotonic()
    try:
        gang = await run_blocking(plan.connect, name="init", seconds=plan.timeout)
    except GangInitError:
        raise
    except Exception as exc:
        raise plan.failed(exc, time.monotonic() - started) from exc
    if gang is None:
        raise plan.failed(None, time.monotonic() - started)
    log.info("agang: %r is up after %.2f s.", gang, time.monotonic() - started)
    return gang


def init_sync(
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout: float | None = DEFAULT_INIT_TIMEOUT,
    op_timeout: float | None = DEFAULT_OP_TIMEOUT,
    env: Mapping[str, str] | None = None,
    in_process: bool | None = None,
    stream_ordered: bool = False,
) -> Gang:
    """:func:`init` for programs without an event loop; blocks at most ``timeout`` seconds.

    Example:
        >>> gang = agang.init_sync()
        >>> gang.all_reduce(torch.ones(1)).wait()
    """
    plan = _Plan(
        backend=backend,
        device=device,
        timeout=timeout,
        op_timeout=op_timeout,
        env=env,
        in_process=in_process,
        stream_ordered=stream_ordered,
    )
    if plan.in_process:
        return plan.local_gang()
    started = time.monotonic()
    handle = start_thread(plan.connect, name="init")
    try:
        gang = handle.wait(plan.timeout)
    except TimeoutError:
        raise plan.failed(None, time.monotonic() - started) from None
    except GangInitError:
        raise
    except Exception as exc:
        raise plan.failed(exc, time.monotonic() - started) from exc
    log.info("agang: %r is up after %.2f s.", gang, time.monotonic() - started)
    return gang
