"""The c10d behaviour that a weights round's confirmation relies on
(``agang._weights.service`` rule 2): on Gloo, a rank's barrier ends only after the ops
that rank posted before it ended (c10d's Gloo barrier waits for the rank's earlier
work before it meets the others), so a subscriber's barrier says that its buckets
came, with no Python of its own in between.

Rank 1 posts a broadcast of 32 MiB and a barrier before rank 0 sends, and waits for
the barrier alone: its broadcast must have ended by then, every time.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from agang.testing import run_world

pytestmark = pytest.mark.gloo

ROUNDS = 10
FLOATS = 8 << 20  # 32 MiB: long enough on loopback to be seen arriving


def _rounds() -> list[bool]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        group = dist.group.WORLD
        assert group is not None
        rank = dist.get_rank()
        seen = []
        for number in range(ROUNDS):
            tensor = torch.full((FLOATS,), float(number)) if rank == 0 else torch.zeros(FLOATS)
            if rank == 0:
                time.sleep(0.05)  # rank 1 posts both first
            arriving = dist.broadcast(tensor, 0, async_op=True)
            agreed = dist.barrier(async_op=True)
            assert arriving is not None
            assert agreed is not None
            agreed.wait()
            seen.append(arriving.is_completed())
            arriving.wait()
            assert tensor[-1].item() == float(number)
        return seen
    finally:
        dist.destroy_process_group()


def test_a_gloo_barrier_ends_after_the_ops_posted_before_it() -> None:
    for seen in run_world(_rounds, 2, make_gang=False, timeout=120.0):
        assert seen == [True] * ROUNDS
