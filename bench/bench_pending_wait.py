"""CPU that waiting costs: 1,000 ops pending for a second, awaited on each loop.

Method:
    Two ranks run as real processes on 127.0.0.1 over Gloo. For each wait mode
    (``park``, ``block_briefly``) and loop (asyncio, uvloop, trio), after a barrier and
    50 warm-up all-reduces (which teach ``block_briefly`` that small ops are fast):

    - rank 0 issues N all-reduces of 4 B at once and starts one task per handle, each
      awaiting it; once every task waits, it reads its loop thread's CPU time
      (``time.thread_time``), the process's (``time.process_time``) and the wall clock,
      and reads them again when the first handle has finished;
    - rank 1 sleeps HOLD seconds before issuing the same N ops, so rank 0's stay
      pending that long.

    Then the same with one op: its one waiter is the case where ``block_briefly``
    blocks first (no other waiter, small ops fast so far), then parks.

    The loop thread's CPU over the pending stretch is what waiting costs (the waiters,
    the loop, agang's wake-up path); the rest of the process's CPU is c10d's threads
    (Gloo's TCP loop polls while ops are in flight), reported apart. The target: the
    loop thread under 2% of a core.

Usage:
    python bench/bench_pending_wait.py             # 1,000 ops held 1 s, about 25 s
    python bench/bench_pending_wait.py --smoke     # 100 ops held 0.2 s: for tests

Writes ``bench/out/pending_wait.json`` (``--out DIR`` writes it elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _common
import anyio
import anyio.lowlevel
import torch
import torch.distributed as dist

import agang
from agang._policy import WaitMode
from agang.testing import run_world

TARGET = 0.02  # of a core
WAIT_MODES: tuple[WaitMode, ...] = ("park", "block_briefly")
LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {"use_uvloop": False}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
WARMUP_OPS = 50


@dataclass(frozen=True)
class Plan:
    num_ops: int
    hold: float  # seconds rank 1 holds the ops back


@dataclass(frozen=True)
class Row:
    wait_mode: str
    loop: str
    num_ops: int
    pending: float  # seconds from every task waiting to the first handle finished
    loop_cpu: float  # the loop thread's CPU seconds over that stretch
    other_cpu: float  # the rest of the process's (c10d's threads)

    @property
    def loop_share(self) -> float:
        return self.loop_cpu / self.pending


async def _hold_pending(
    gang: agang.Gang, plan: Plan, num_ops: int, rank: int
) -> tuple[float, float, float]:
    tensor = torch.zeros(1)
    for _ in range(WARMUP_OPS):
        await gang.all_reduce(tensor)
    await gang.barrier()
    if rank != 0:
        await anyio.sleep(plan.hold)
    tensors = [torch.zeros(1) for _ in range(num_ops)]
    handles = [gang.all_reduce(t) for t in tensors]
    first_done = anyio.Event()
    stamps: list[tuple[float, float, float]] = []

    async def await_one(handle: agang.Handle[Any]) -> None:
        await handle
        if not first_done.is_set():
            stamps.append((time.monotonic(), time.thread_time(), time.process_time()))
            first_done.set()

    if num_ops == 1:
        # Awaited by the main task itself, with nothing else on the loop: the await
        # that ``block_briefly`` blocks (a task group's waiter finds the main task ready).
        start = (time.monotonic(), time.thread_time(), time.process_time())
        await handles[0]
        end = (time.monotonic(), time.thread_time(), time.process_time())
        return end[0] - start[0], end[1] - start[1], end[2] - start[2]
    async with anyio.create_task_group() as group:
        for handle in handles:
            group.start_soon(await_one, handle)
        for _ in range(3):  # let every task reach its await
            await anyio.lowlevel.checkpoint()
        start = (time.monotonic(), time.thread_time(), time.process_time())
        await first_done.wait()
    end = stamps[0]
    return end[0] - start[0], end[1] - start[1], end[2] - start[2]


def _rank_main(plan: Plan) -> list[Row]:
    """A rank's process: one gang (made sync: each measurement runs its own loop)."""
    gang = agang.init_sync(in_process=False, timeout=60.0, op_timeout=120.0)
    rank = gang.rank
    rows = []
    try:
        for wait_mode in WAIT_MODES:
            # Set on the one gang, as AGANG_WAIT_MODE would for every gang.
            policy = dataclasses.replace(gang.policy, wait_mode=wait_mode)
            gang._engine.policy = policy  # type: ignore[attr-defined]
            for num_ops in (plan.num_ops, 1):
                for loop, (backend, options) in LOOPS.items():
                    pending, loop_cpu, process_cpu = anyio.run(
                        _hold_pending,
                        gang,
                        plan,
                        num_ops,
                        rank,
                        backend=backend,
                        backend_options=options,
                    )
                    other_cpu = process_cpu - loop_cpu
                    rows.append(Row(wait_mode, loop, num_ops, pending, loop_cpu, other_cpu))
        dist.barrier()
    finally:
        gang.close_sync()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help="100 ops held 0.2 s")
    _common.add_out_argument(parser)
    args = parser.parse_args(argv)
    plan = Plan(100, 0.2) if args.smoke else Plan(1000, 1.0)
    print(f"2 Gloo ranks; rank 1 holds {plan.num_ops} all-reduces back {plan.hold:g} s.\n")
    rows = run_world(
        functools.partial(_rank_main, plan), _common.WORLD_SIZE, make_gang=False, timeout=300.0
    )[0]
    print(
        f"{'wait mode':<14} {'loop':<8} {'ops':>5} {'pending':>8} {'loop CPU':>9} {'share':>7}"
        "  c10d CPU"
    )
    for row in rows:
        verdict = "PASS" if row.loop_share < TARGET else "MISS"
        c10d_share = row.other_cpu / row.pending
        print(
            f"{row.wait_mode:<14} {row.loop:<8} {row.num_ops:>5} {row.pending:>7.2f}s"
            f" {row.loop_cpu * 1e3:>6.1f} ms {row.loop_share:>6.2%}  {c10d_share:>6.1%}  {verdict}"
            f" (loop < {TARGET:.0%} of a core)"
        )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "method": __doc__.split("Usage:")[0].strip() if __doc__ else "",
        "torch": torch.__version__,
        "plan": asdict(plan),
        "target_loop_share": TARGET,
        "rows": [{**asdict(row), "loop_share": row.loop_share} for row in rows],
    }
    (out / "pending_wait.json").write_text(json.dumps(document, indent=1))
    print(f"\nWrote {out / 'pending_wait.json'}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
