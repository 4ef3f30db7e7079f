"""The c10d groups a child made by ``os.fork()`` inherits: kept for ever, never shut down.

Rules:
1. A c10d group freed in a forked child would run its destructor there: it joins worker
   threads that exist only in the parent, and closes the connections it shares with the
   parent. So the child holds every group c10d knows with a reference it never drops,
   not even when its interpreter finalizes.
2. When agang's world was up at the fork, c10d's registry of groups is emptied in the
   child, with nothing shut down (what ``destroy_process_group`` does to its tables,
   without its calls to the groups), so that ``agang.init()`` there makes a world of its
   own instead of wrapping the parent's, and a stray ``torch.distributed`` call in the
   child finds no group instead of the parent's.
"""

from __future__ import annotations

import ctypes
import logging

import torch.distributed as dist

log = logging.getLogger("agang.c10d")


def disown_groups(*, forget_world: bool) -> None:
    """In a forked child: keeps every inherited group for ever (rule 1), and empties
    c10d's registry if ``forget_world`` (rule 2). Never raises."""
    try:
        c10d = dist.distributed_c10d
        world = c10d._world
        for kept in [*world.pg_map, *world.comms]:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))
        if not forget_world:
            return
        c10d._update_default_pg(None)
        world.comms.clear()
        for table in (
            world.pg_map,
            world.pg_names,
            world.pg_group_ranks,
            world.pg_backend_config,
            world.pg_to_tag,
            world.tags_to_pg,
            world.pg_coalesce_state,
        ):
            table.clear()
        c10d._unregister_all_process_groups()  # type: ignore[attr-defined]
        world.group_count = 0
    except Exception:
        log.warning(
            "agang: forgetting the inherited c10d groups in a forked child failed.", exc_info=True
        )
