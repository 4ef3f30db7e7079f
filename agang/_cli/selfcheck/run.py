"""``agang selfcheck``: runs the checks on GPUs, or on the simulation without one."""

from __future__ import annotations

import logging
from typing import TextIO

import anyio
import torch

from agang._cli.selfcheck.checks import run_checks
from agang._cli.selfcheck.harness import Harness, SimulatedHarness
from agang._cli.selfcheck.report import Row, merge, passed, render


async def _open(simulate: bool) -> tuple[Harness, str]:
    if simulate:
        return SimulatedHarness(), "(simulation asked for)"
    if not torch.cuda.is_available():
        return SimulatedHarness(), "(no GPU found: the same checks on the simulation)"
    from agang._cli.selfcheck.cuda_harness import CudaHarness

    return await CudaHarness.open(), ""


async def _main(simulate: bool, out: TextIO) -> int:
    harness, why = await _open(simulate)
    try:
        rows = await run_checks(harness)
        gathered = await harness.gather([(r.check, r.result, r.figure) for r in rows])
    finally:
        await harness.close()
    per_rank = [[Row(c, r, f) for c, r, f in rows] for rows in gathered]  # type: ignore[arg-type]
    merged = merge(per_rank)
    if harness.prints:  # one rank prints the table for all
        out.write(render(f"agang selfcheck: {harness.description} {why}".rstrip(), merged))
        out.flush()
    return 0 if passed(merged) else 1


def selfcheck(*, simulate: bool, out: TextIO, verbose: bool = False) -> int:
    """Runs every check; writes the table to ``out``; 0 only when all passed.

    Args:
        simulate: Run on the simulation even where a GPU is present.
        out: Where the table goes.
        verbose: Keep agang's log records; by default they are held back, since the
            checks break gangs on purpose and each break logs an error.
    """
    logger = logging.getLogger("agang")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.CRITICAL)
    try:
        return anyio.run(_main, simulate, out)
    finally:
        logger.setLevel(level)
