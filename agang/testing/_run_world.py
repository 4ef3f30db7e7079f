"""Running an async function on n real local ranks (processes, Gloo, loopback only).

The parent hosts the rendezvous store on 127.0.0.1 with port 0, so the port is chosen
by the kernel with no race, and tells the ranks to join it as clients, exactly as
torchrun's agent does (TORCHELASTIC_USE_AGENT_STORE). Every rank runs under the chosen
async backend; the parent collects each rank's result or formatted traceback, and at the
deadline, or once any rank failed and the others did not finish soon after, it kills the
ranks it started (SIGKILL, by pid) and raises with the tracebacks tagged by rank. A rank
that delivered its result is not blamed for being slow to exit afterwards: killed once its
exit grace passed, it is logged (``agang.testing``), not failed; one that exits on its own
with another code than 0 still fails.

With ``make_gang=False`` a rank makes no gang and runs no event loop: it calls a plain
``fn()`` with the world's environment set, for code that makes its own gangs (several in
turn, or with ``agang.init_sync``) or times its own set-up, as the benchmarks do.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast, overload

import torch.distributed as dist

from agang._errors import GangError
from agang._gang import Gang
from agang._validate import check_positive_int, check_timeout

T = TypeVar("T")

log = logging.getLogger("agang.testing")

ASYNC_BACKENDS = ("asyncio", "uvloop", "trio")
# After the first failure, how long the other ranks get to report theirs.
_GRACE = 3.0
# How long a rank that returned its result may take to exit before it is killed (and
# logged, not failed: its result is in).
_EXIT_GRACE = 15.0


class WorldRunError(GangError):
    """One or more ranks of [`run_world`][agang.testing.run_world] failed or missed the deadline.

    Attributes:
        failures: Rank -> formatted traceback (or why it gave no result).
        results: Rank -> result, for the ranks that succeeded.
    """

    def __init__(self, message: str, failures: dict[int, str], results: dict[int, Any]) -> None:
        super().__init__(message)
        self.failures = failures
        self.results = results


def _rank_main(
    fn: Callable[..., Any],
    env: dict[str, str],
    backend: str,
    async_backend: str,
    init_options: dict[str, Any] | None,
    connection: multiprocessing.connection.Connection,
) -> None:
    """A rank's process: ``fn(gang)`` under ``async_backend``, or ``fn()`` alone where
    ``init_options`` is None (``make_gang=False``)."""
    os.environ.update(env)
    import anyio

    import agang

    async def main() -> Any:
        assert init_options is not None
        gang = await agang.init(backend=backend, in_process=False, **init_options)
        try:
            return await fn(gang)
        finally:
            await gang.close()

    try:
        if init_options is None:
            result = fn()
        elif async_backend == "trio":
            result = anyio.run(main, backend="trio")
        else:
            result = anyio.run(
                main, backend="asyncio", backend_options={"use_uvloop": async_backend == "uvloop"}
            )
    except BaseException:
        connection.send(("error", traceback.format_exc()))
    else:
        try:
            # Plain pickle: the connection's ForkingPickler would share a tensor's storage
            # by file descriptor, which dies with this process before the parent reads it.
            connection.send(("ok", pickle.dumps(result)))
        except Exception:
            connection.send(
                ("error", "the result could not be pickled:\n" + traceback.format_exc())
            )
    connection.close()


@overload
def run_world(
    fn: Callable[[Gang], Awaitable[T]],
    world_size: int,
    *,
    backend: str = ...,
    async_backend: str = ...,
    timeout: float = ...,
    init_timeout: float | None = ...,
    op_timeout: float | None = ...,
    env: Mapping[str, str] | None = ...,
    init_options: Mapping[str, Any] | None = ...,
    make_gang: Literal[True] = ...,
) -> list[T]: ...


@overload
def run_world(
    fn: Callable[[], T],
    world_size: int,
    *,
    timeout: float = ...,
    env: Mapping[str, str] | None = ...,
    make_gang: Literal[False],
) -> list[T]: ...


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "gloo",
    async_backend: str = "asyncio",
    timeout: float = 120.0,
    init_timeout: float | None = 60.0,
    op_timeout: float | None = 60.0,
    env: Mapping[str, str] | None = None,
    init_options: Mapping[str, Any] | None = None,
    make_gang: bool = True,
) -> list[Any]:
    """Runs ``async def fn(gang)`` on ``world_size`` local ranks and returns their results.

    ``fn`` must be importable by name (a module-level function, or a
    ``functools.partial`` of one): ranks are new processes.

    Args:
        fn: The function each rank runs with its root gang; its result must pickle.
        world_size: The number of ranks.
        backend: The c10d backend (``"gloo"``).
        async_backend: ``"asyncio"``, ``"uvloop"`` or ``"trio"``.
        timeout: Seconds for the whole run, start-up included; never exceeded by more
            than the few seconds killing takes.
        init_timeout: The ranks' [`agang.init`][agang.init] deadline (None: init's default;
            ``math.inf``: none).
        op_timeout: The ranks' default op deadline (as ``init``'s).
        env: Extra environment variables for the ranks.
        init_options: More keyword arguments for the ranks' [`agang.init`][agang.init], such
            as ``on_timeout``, ``limits`` or ``check_order``; they must pickle.
        make_gang: False: each rank calls a plain ``fn()`` instead, with no gang and no
            event loop, in a process whose environment is the world's (torchrun's
            variables), so ``agang.init_sync()`` there joins the others. ``backend``,
            ``async_backend``, ``init_timeout`` and ``op_timeout`` then have no use (the
            type checker refuses them), and ``init_options`` must be None.

    Returns:
        The results, indexed by rank.

    Raises:
        WorldRunError: A rank failed or the deadline passed; lists each rank's traceback.
            A rank that returned its result and then exited with a code other than 0 on
            its own (a crash at exit) failed too; one that was still exiting 15 s after
            its result came, and was killed for it, did not: on a loaded machine a
            clean exit can take that long. It is logged as a warning (logger
            ``agang.testing``) and its result is returned.

    Example:
        <!-- not-run: run_world spawns processes: the function must be importable by name -->
        ```python
        async def total(gang):
            return (await gang.all_reduce(torch.ones(1))).item()
        run_world(total, 2)  # [2.0, 2.0]
        ```
    """
    check_positive_int(world_size, name="world_size")
    if async_backend not in ASYNC_BACKENDS:
        raise ValueError(
            f"`async_backend` must be one of {ASYNC_BACKENDS}, but is {async_backend!r} instead."
        )
    seconds = check_timeout(timeout)
    if seconds is None:
        raise ValueError("`timeout` must be a number of seconds, but is None instead.")
    if not callable(fn):
        raise TypeError(f"`fn` must be an async function, but is {fn!r} instead.")
    if not make_gang and init_options is not None:
        raise ValueError(
            f"`init_options` must be None when `make_gang` is False (no rank makes a gang), "
            f"but is {init_options!r} instead."
        )

    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=seconds),
        wait_for_workers=False,
    )
    context = multiprocessing.get_context("spawn")
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **(env or {}),
    }
    # None tells each rank to make no gang (make_gang=False).
    rank_init_options = (
        {"timeout": init_timeout, "op_timeout": op_timeout, **(init_options or {})}
        if make_gang
        else None
    )
    processes = []
    connections: dict[Any, int] = {}  # receiving end of each rank's pipe -> rank
    for rank in range(world_size):
        receiver, sender = context.Pipe(duplex=False)
        rank_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        process = context.Process(
            target=_rank_main,
            args=(fn, rank_env, backend, async_backend, rank_init_options, sender),
            name=f"agang-rank-{rank}",
            daemon=True,
        )
        process.start()
        sender.close()
        processes.append(process)
        connections[receiver] = rank

    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    killed: set[int] = set()  # ranks this function killed (SIGKILL)
    deadline = time.monotonic() + seconds
    try:
        while connections:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = multiprocessing.connection.wait(list(connections), timeout=remaining)
            for ready_end in ready:
                rank = connections.pop(ready_end)
                # Only the pipes' read ends were waited on.
                receiver = cast("multiprocessing.connection.Connection[Any, Any]", ready_end)
                try:
                    status, payload = receiver.recv()
                except (EOFError, OSError):
                    code = processes[rank].exitcode
                    status, payload = "error", f"rank {rank} exited (code {code}) without a result"
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    failures[rank] = payload
                    deadline = min(deadline, time.monotonic() + _GRACE)
    finally:
        for rank, process in enumerate(processes):
            # A rank that reported gets time to exit cleanly; the others are stuck.
            grace = _EXIT_GRACE if rank in results else 0.0
            process.join(timeout=max(grace, min(2.0, deadline - time.monotonic())))
            if process.is_alive():
                process.kill()
                killed.add(rank)
                process.join(timeout=5.0)
        del store
    for rank in connections.values():
        failures.setdefault(rank, f"rank {rank} gave no result within the {seconds:g} s deadline")
    for rank in list(results):
        code = processes[rank].exitcode
        if code == 0:
            continue
        if rank in killed:
            # Killed here for being slow to exit, not crashed: its work is done and its
            # result in (a loaded machine, a thread finishing), so it is no failure.
            log.warning(
                "rank %d returned its result, then was still exiting after %g s; "
                "killed it (exit code %s)",
                rank,
                _EXIT_GRACE,
                code,
            )
            continue
        # A crash at exit (a c10d abort, say) is a failure even after a good result.
        failures[rank] = f"rank {rank} returned its result, then exited with code {code}"
    if failures:
        report = "\n".join(
            f"--- rank {rank} ---\n{failures[rank].rstrip()}" for rank in sorted(failures)
        )
        raise WorldRunError(
            f"{len(failures)} of {world_size} ranks failed:\n{report}", failures, results
        )
    return [results[rank] for rank in range(world_size)]
