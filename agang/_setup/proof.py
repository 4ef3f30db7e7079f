"""What every set-up path finishes with: a group proven by a barrier, and errors that
let go of what they held.
"""

from __future__ import annotations

import time
import traceback
from datetime import timedelta

import torch.distributed as dist

#: The most the proving barrier waits (seconds), within the set-up's deadline.
BARRIER_SECONDS = 30.0


def prove(deadline: float) -> None:
    """A barrier on the new default group, before any gang exists (so it takes no seq
    number); the group is destroyed if it fails."""
    options = dist.BarrierOptions()
    seconds = max(0.1, min(BARRIER_SECONDS, deadline - time.monotonic()))
    options.timeout = timedelta(seconds=seconds)
    try:
        dist.distributed_c10d._get_default_group().barrier(options).wait(timedelta(seconds=seconds))
    except BaseException:
        dist.destroy_process_group()
        raise


def clear_frames(error: BaseException) -> None:
    """Drops the frames of ``error`` and its causes: their locals (a hosted store, its
    port) would otherwise live as long as the caller keeps the error."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
