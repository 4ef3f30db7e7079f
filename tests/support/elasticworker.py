"""One elastic rank's program (forked by ``tests/support/elasticrun.py``): it runs the commands
its test sends over the control connection and answers with events.

Commands (``{"do": ...}``) and their events (``{"what": ...}``):

- ``init`` (``min_size``, ``max_size``, ``timeout``, ``op_timeout``, ``reform_timeout``,
  ``die_in_make_group``): calls ``agang.init(elastic=...)``; ``epoch``, or ``init_failed``
  (the error, and ``logs``: agang's INFO lines meanwhile). With ``die_in_make_group`` N, the process
  SIGKILLs itself as it starts making epoch N's group (a death inside a reform). With
  ``close_takes`` S, closing a gang takes S seconds more (a slow abort of its communicator).
- ``all_reduce`` (``numel``, ``repeat``): all-reduces ``repeat`` times, saying ``issued``
  before each and ``done`` (with whether the sum was exact) after; ``reduced`` at the end.
- ``recv`` (``source``): says ``issued``, then receives from ``source``.
- ``reform`` (``timeout``, ``after_joiner``): reforms (once a joiner waits, with
  ``after_joiner``); ``epoch`` (with ``decided_in``: how long deciding its members took
  here) or ``reform_failed``.
- ``waiting``: says ``waiting`` once a joiner waits (``waiting_to_join() > 0``).
- ``noticed``: says ``noticed`` once a joiner told this member that it waits, with how
  many did and ``waiting_to_join()`` (which counts only those a reform can admit).
- ``count``: says ``count`` with ``waiting_to_join()`` at once (or the error it raised).
- ``old``: calls ops on the gang of the previous epoch; ``old`` lists the outcomes.
- ``stats``: ``stats`` with threads (the kernel's count, and the Python threads' names), open fds
  (and what each is), RSS and the loop's lag (p99, max).
- ``exit``: closes the gang and ends the process with status 0.

An op that fails says ``failed`` (the error, and ``peers``: the blame of a deadline),
then, unless the command says ``reform_after: false``, reforms as a training loop does.
"""

from __future__ import annotations

import faulthandler
import functools
import gc
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import anyio
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

import agang
from agang._setup import elastic as elastic_setup
from agang._setup import membership

TICK = 0.01
#: How long each decision of an epoch's members took here (``membership.form``), newest last.
DECISIONS: list[float] = []
_form = membership.form


def _timed_form(*arguments: Any, **keywords: Any) -> Any:
    started = time.monotonic()
    try:
        return _form(*arguments, **keywords)
    finally:
        DECISIONS.append(time.monotonic() - started)


membership.form = _timed_form  # type: ignore[assignment]


class Rank:
    """The rank's state: its control stream, its gang (and the previous epoch's), and
    the loop-lag samples of its ticker."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.gang: Any = None
        self.previous: Any = None
        self.lags: list[float] = []
        self.settings: dict[str, Any] = {}
        self.blind_until = 0.0
        self.born = time.monotonic()
        self.spikes: list[Any] = []
        self.last = ""

    async def say(self, what: str, **fields: Any) -> None:
        self.last = f"{what} at {time.monotonic() - self.born:.3f}"
        await self.stream.send((json.dumps({"what": what, **fields}) + "\n").encode())

    async def tick(self) -> None:
        """The loop's lag: how late each 10 ms sleep wakes (a blocked loop wakes late)."""
        while True:
            started = time.monotonic()
            await anyio.sleep(TICK)
            if started >= self.blind_until:  # not a tick that this program's gc held up
                self.lags.append(time.monotonic() - started - TICK)
                if self.lags[-1] > 0.02:  # when, how late, and after which event
                    self.spikes.append((started - self.born, self.lags[-1], self.last))

    async def new_epoch(self, gang: Any, took: float) -> None:
        self.previous, self.gang = self.gang, gang
        decided_in = DECISIONS[-1] if DECISIONS else None
        await self.say(
            "epoch",
            epoch=gang.epoch,
            rank=gang.rank,
            size=gang.size,
            took=took,
            decided_in=decided_in,
            backend=gang.backend,
        )

    async def reform(self, seconds: float) -> None:
        started = time.monotonic()
        try:
            gang = await self.gang.reform(timeout=seconds)
        except agang.GangError as error:
            took = time.monotonic() - started
            await self.say(
                "reform_failed", error=type(error).__name__, message=str(error), took=took
            )
            return
        await self.new_epoch(gang, time.monotonic() - started)

    async def failed(self, error: agang.GangError, command: dict[str, Any]) -> None:
        peers = {str(rank): text for rank, text in getattr(error, "peers", {}).items()}
        await self.say(
            "failed", error=type(error).__name__, message=str(error), peers=peers, at=time.time()
        )
        if command.get("reform_after", True):
            await self.reform(self.settings["reform_timeout"])


async def _init(rank: Rank, command: dict[str, Any]) -> None:
    rank.settings = command
    dying = command.get("die_in_make_group")
    if dying is not None:
        make_group = elastic_setup.make_group

        def dies_in_make_group(formed: Any, *arguments: Any, **keywords: Any) -> Any:
            if formed.epoch == dying:
                os.kill(os.getpid(), signal.SIGKILL)
            return make_group(formed, *arguments, **keywords)

        elastic_setup.make_group = dies_in_make_group  # type: ignore[assignment]
    slow = command.get("close_takes")
    if slow is not None:
        close = agang.ElasticGang.close

        async def slow_close(gang: agang.ElasticGang) -> None:
            await anyio.sleep(slow)
            await close(gang)

        agang.ElasticGang.close = slow_close  # type: ignore[method-assign]
    logs = _Collect()
    logger = logging.getLogger("agang")
    logger.addHandler(logs)
    level = logger.level
    logger.setLevel(logging.INFO)
    started = time.monotonic()
    try:
        gang = await agang.init(
            elastic=agang.Elastic(min_size=command["min_size"], max_size=command.get("max_size")),
            timeout=command["timeout"],
            op_timeout=command["op_timeout"],
        )
    except agang.GangError as error:
        took = time.monotonic() - started
        name, text = type(error).__name__, str(error)
        await rank.say("init_failed", error=name, message=text, took=took, logs=logs.lines)
        return
    finally:
        logger.removeHandler(logs)
        logger.setLevel(level)
    await rank.new_epoch(gang, time.monotonic() - started)


class _Collect(logging.Handler):
    """The lines agang logs (INFO and up) while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def _all_reduce(rank: Rank, command: dict[str, Any]) -> None:
    numel, exact = command.get("numel", 4), 0
    for step in range(command.get("repeat", 1)):
        gang = rank.gang
        value = float(gang.rank + 1 + step)
        # Filling and checking 64 MiB takes the loop tens of ms: done on a thread.
        # On the gang's device: a GPU's under NCCL (the device check's real-NCCL run).
        fill = functools.partial(torch.full, (numel,), value, device=gang.device)
        tensor = await anyio.to_thread.run_sync(fill)
        try:
            handle = gang.all_reduce(tensor)
            await rank.say("issued", step=step)
            total = await handle
        except agang.GangError as error:  # a broken gang refuses the call itself
            await rank.failed(error, command)
            return
        expected = gang.size * (gang.size + 1) / 2 + gang.size * step
        right = await anyio.to_thread.run_sync(_all_equal, total, expected)
        exact += right
        await rank.say("done", step=step, exact=right)
    await rank.say("reduced", exact=exact, epoch=rank.gang.epoch)


def _all_equal(tensor: torch.Tensor, value: float) -> bool:
    return bool((tensor == value).all())


async def _recv(rank: Rank, command: dict[str, Any]) -> None:
    try:
        handle = rank.gang.recv(
            torch.empty(4, device=rank.gang.device), source_rank=command["source"]
        )
        await rank.say("issued", step=0)
        await handle
    except agang.GangError as error:
        await rank.failed(error, command)


async def _reform(rank: Rank, command: dict[str, Any]) -> None:
    if command.get("after_joiner"):
        while rank.gang.waiting_to_join() == 0:  # noqa: ASYNC110 (a local read: polled)
            await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # its arrival at the reform (it polls every 50 ms)
    await rank.reform(command.get("timeout", rank.settings["reform_timeout"]))


async def _waiting(rank: Rank, command: dict[str, Any]) -> None:
    """Says ``waiting`` once a joiner has told this member that it waits."""
    with anyio.fail_after(command.get("timeout", 10)):
        while rank.gang.waiting_to_join() == 0:  # noqa: ASYNC110 (a local read: polled)
            await anyio.sleep(0.01)
    await rank.say("waiting", joiners=rank.gang.waiting_to_join())


async def _noticed(rank: Rank, command: dict[str, Any]) -> None:
    """Says ``noticed`` once a joiner has told this member that it waits, whether or not
    a reform could admit it."""
    with anyio.fail_after(command.get("timeout", 10)):
        while not elastic_setup.noticed():  # noqa: ASYNC110 (a local read: polled)
            await anyio.sleep(0.01)
    await rank.say(
        "noticed", noticed=len(elastic_setup.noticed()), joiners=rank.gang.waiting_to_join()
    )


async def _count(rank: Rank, command: dict[str, Any]) -> None:
    """Says ``count`` with ``waiting_to_join()`` as it reads now, or with the error it
    raised (a gang whose store was lost)."""
    try:
        joiners = rank.gang.waiting_to_join()
    except agang.GangError as error:
        await rank.say("count", error=type(error).__name__, message=str(error))
        return
    await rank.say("count", joiners=joiners)


async def _old(rank: Rank, command: dict[str, Any]) -> None:
    outcomes: list[str] = []
    gang = rank.previous if command.get("previous", True) else rank.gang
    for _ in range(command.get("calls", 5)):
        try:
            with anyio.fail_after(5):
                await gang.all_reduce(torch.ones(4, device=gang.device))
            outcomes.append("succeeded")
        except agang.GangError as error:
            outcomes.append(type(error).__name__)
    await rank.say("old", outcomes=outcomes)


def _fd_kinds() -> list[str]:
    """What each open fd is (socket, pipe, anon_inode:[eventpoll], a path)."""
    kinds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
        kinds.append(target.split(":[")[0] if target.startswith(("socket", "pipe")) else target)
    return kinds


async def _stats(rank: Rank, command: dict[str, Any]) -> None:
    lags = sorted(rank.lags) or [0.0]
    # Garbage awaiting collection (a cycle holding a socket) is no leak; the collection
    # holds the loop for tens of ms, which is this program's doing, not agang's.
    gc.collect()
    rank.blind_until = time.monotonic()
    statm = await anyio.Path("/proc/self/statm").read_text()
    rss = int(statm.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    await rank.say(
        "stats",
        threads=len(os.listdir("/proc/self/task")),  # the kernel's count: native ones too
        python_threads=sorted(thread.name for thread in threading.enumerate()),
        fd_kinds=sorted(_fd_kinds()),
        fds=len(os.listdir("/proc/self/fd")),
        rss=rss,
        lag_p99=lags[int(0.99 * (len(lags) - 1))],
        lag_max=lags[-1],
        ticks=len(rank.lags),
        spikes=rank.spikes,
    )


COMMANDS = {
    "init": _init,
    "all_reduce": _all_reduce,
    "recv": _recv,
    "reform": _reform,
    "waiting": _waiting,
    "noticed": _noticed,
    "count": _count,
    "old": _old,
    "stats": _stats,
}


async def _main() -> int:
    host, port = os.environ["ELASTICRUN_CONTROL"].rsplit(":", 1)
    stream = await anyio.connect_tcp(host, int(port))
    rank = Rank(stream)
    await rank.say("hello", pid=os.getpid())
    lines = BufferedByteReceiveStream(stream)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(rank.tick)
        while True:
            try:
                line = await lines.receive_until(b"\n", 1 << 20)
            except (anyio.EndOfStream, anyio.IncompleteRead, OSError):
                break  # the test is gone: so is this rank
            command = json.loads(line)
            if command["do"] == "exit":
                break
            try:
                await COMMANDS[command["do"]](rank, command)
            except Exception as error:  # the test sees it at once, not as a silent end
                await rank.say("crashed", error=repr(error))
                raise
        if rank.gang is not None:
            await rank.gang.close()
        tasks.cancel_scope.cancel()
    return 0


def run() -> int:
    """The rank's life, bounded by an alarm (no rank outlives its test)."""
    signal.alarm(120)
    faulthandler.register(signal.SIGUSR1)  # a stuck rank's stacks, on request
    return anyio.run(_main)
