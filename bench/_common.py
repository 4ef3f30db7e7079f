"""What the benchmarks share: starting 2 local Gloo ranks, collecting results, formatting.

The parent hosts the TCPStore on 127.0.0.1 with port 0 (the kernel picks a free port,
with no race) and starts each rank as a spawned process that joins it as a client, as
torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE``). A rank's target is a
module-level function ``target(env, payload, conn)`` that sends ``("ok", result)`` or
``("error", traceback text)`` on ``conn``; :func:`run_ranks` returns the results in rank
order, or raises with the failing rank's traceback, and never leaves a rank running.

Every bench prints its table and writes its JSON with or without matplotlib (it comes
with agang's ``dev`` extra); plots are drawn only where it is installed
(:func:`write_plots`), and a run without it says so in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

WORLD_SIZE = 2
OUT_DIR = Path(__file__).resolve().parent / "out"

RankTarget = Callable[[dict[str, str], Any, Connection], None]


def rank_env(rank: int, port: int, world_size: int = WORLD_SIZE) -> dict[str, str]:
    """The torchrun-style environment of one local rank joining the store at ``port``."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def _receive(rank: int, conn: Connection) -> Any:
    try:
        status, payload = conn.recv()
    except EOFError:
        raise RuntimeError(f"Rank {rank} exited without sending its results.") from None
    if status != "ok":
        raise RuntimeError(f"Rank {rank} failed:\n{payload}")
    return payload


def _collect(conns: list[Connection], deadline: float) -> list[Any]:
    """Each rank's result, in rank order; raises on a rank's error or at the deadline."""
    results: dict[int, Any] = {}
    pending = dict(enumerate(conns))
    while pending:  # bounded: every pass takes one result or raises
        ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"Ranks {sorted(pending)} did not finish before the deadline.")
        for rank, conn in list(pending.items()):
            if conn in ready:
                results[rank] = _receive(rank, conn)
                del pending[rank]
    return [results[rank] for rank in range(len(conns))]


def _stop(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        process.join(timeout=10.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)


def run_ranks(
    target: RankTarget, payload: Any, timeout: float, world_size: int = WORLD_SIZE
) -> list[Any]:
    """Runs ``target(env, payload, conn)`` on ``world_size`` local ranks; their results."""
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    processes: list[BaseProcess] = []
    conns: list[Connection] = []
    try:
        for rank in range(world_size):
            receiver, sender = context.Pipe(duplex=False)
            env = rank_env(rank, store.port, world_size)
            process = context.Process(target=target, args=(env, payload, sender), daemon=True)
            process.start()
            sender.close()
            processes.append(process)
            conns.append(receiver)
        return _collect(conns, time.monotonic() + timeout)
    finally:
        _stop(processes)


def run_async_rank(
    env: dict[str, str], conn: Connection, main: Callable[[], Coroutine[Any, Any, Any]]
) -> None:
    """In a rank's process: takes the rank's environment, gives torch one CPU thread (two
    ranks share the machine), runs ``main()`` with asyncio and sends its result."""

    def run() -> Any:
        os.environ.update(env)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch

        torch.set_num_threads(1)
        return asyncio.run(main())

    send_result(conn, run)


def send_result(conn: Connection, measure: Callable[[], Any]) -> None:
    """In a rank's process: sends ``("ok", measure())`` on ``conn``, or ``("error",
    traceback)`` if it raised, then closes ``conn``: what :func:`run_ranks` expects."""
    try:
        result = measure()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("ok", result))
    finally:
        conn.close()


def percentile(values: Sequence[float], q: int) -> float:
    """The q-th percentile (1..99, inclusive method), or the only value."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def format_bytes(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale} {unit}"
    return f"{num_bytes} B"


def format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.2f} ms"


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--out DIR``: where a bench writes its JSON and plots (default bench/out)."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"`parser` must be an argparse.ArgumentParser, but is {parser!r}.")
    parser.add_argument(
        "--out",
        type=Path,
        default=OUT_DIR,
        metavar="DIR",
        help=f"where to write the JSON and plots (default {OUT_DIR})",
    )


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` on the file-only Agg backend, or None where matplotlib is
    not installed (benches must finish without it: it is only in the dev extra)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(paths: Sequence[Path], draw: Callable[[Any], object]) -> list[Path]:
    """Calls ``draw(pyplot)`` to write ``paths`` and returns them; without matplotlib,
    writes nothing, says so in one line, and returns [].

    Example:
        >>> written = write_plots([out / "latency.png"], lambda plt: plot(plt, rows))
    """
    paths = list(paths)
    if not paths or not all(isinstance(path, Path) for path in paths):
        raise ValueError(f"`paths` must be one or more Paths, but is {paths!r} instead.")
    if not callable(draw):
        raise TypeError(f"`draw` must be callable, but is {draw!r} instead.")
    plt = pyplot()
    if plt is None:
        names = ", ".join(path.name for path in paths)
        print(f"matplotlib is not installed: no {names} (pip install matplotlib to plot).")
        return []
    draw(plt)
    return paths
