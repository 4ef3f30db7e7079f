"""What the benchmarks share: the world size, formatting, ``--out`` and plotting.

Their ranks run on ``agang.testing.run_world``: local processes on Gloo over
127.0.0.1, joining a store the parent hosts, with each rank's result or traceback
brought back. A bench that times its own set-up, or makes its gangs with
``agang.init_sync``, passes ``make_gang=False`` and makes them in the rank.

Every bench prints its table and writes its JSON with or without matplotlib (it comes
with agang's ``dev`` extra); plots are drawn only where it is installed
(:func:`write_plots`), and a run without it says so in one line.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
OUT_DIR = Path(__file__).resolve().parent / "out"


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
        help="where to write the JSON and plots (default: %(default)s)",
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


def on_transfers_ended(callback: Callable[[int], None]) -> None:
    """Calls ``callback(n)`` on agang's c10d waiter thread each time it learns that a
    batch of ``n`` point-to-point transfers ended, before agang reports the op to whoever
    awaits it: the moment c10d's thread knew, for benches that split an op's latency
    there. It wraps the function that thread waits with, an internal of agang's, in this
    process; a gang's waiter takes that function when the gang is made, so call this
    before making the gangs to watch."""
    if not callable(callback):
        raise TypeError(f"`callback` must be callable, but is {callback!r} instead.")
    from agang._backends.c10d import completion

    waited = completion._wait_for_works

    def wait_then_call(works: list[Any]) -> BaseException | None:
        out = waited(works)
        callback(len(works))
        return out

    completion._wait_for_works = wait_then_call
