"""Making a c10d backend's child groups: sub-gangs and lanes.

Rules:
1. On NCCL, a child splits the parent's communicator (``split_group``: cheaper than a
   new one); every rank of the parent takes part, and non-members get None. c10d splits
   only when the default group is bound to a device (``init_process_group`` with
   ``device_id``, as agang's init makes it); a world the user made without one gets
   ``new_group`` instead.
2. Otherwise a child is a ``new_group``. Over the world, every rank of the world takes
   part (c10d's rule), and non-members drop the placeholder they get. Under a sub-gang,
   only members take part (``use_local_synchronization``). An NCCL ``new_group`` is
   given its device, so c10d makes its communicator now, on this thread: made lazily,
   at the first op, it would be made on the caller's loop, under the gang's lock, where
   a member that never comes would hold the loop until NCCL gives up.
3. With order checking on, each child gets its own side Gloo group for its checks. On
   NCCL only its members make it (``use_local_synchronization``): over an NCCL world
   bound to a device, c10d answers a ``new_group`` that a non-member joins by splitting
   the world's NCCL communicator with no colour on that rank alone, a split the members
   never make, so the non-member would hang in it (pytorch#145376).
4. The whole creation runs on a thread, within the gang's op deadline; a store hiccup
   that c10d reports as transient (``agang._backends.c10d.retry.call_c10d``) is retried within it.
5. c10d pairs the ranks' creations by call order alone. Lanes are made on first use, so
   two ranks whose tasks ask for lanes "grads" and "metrics" in opposite orders would get
   one group for both, cross-wired: one lane's ops summed with the other's. So the
   members then compare the child's name under the new group's name (the same on every
   member) in the store, and where any differs, each destroys the group and fails,
   naming what every member made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.c10d.retry import RetryPolicy, call_c10d, retrying
from agang._errors import GangInitError
from agang._runtime.threads import run_blocking

Groups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]


def _can_split() -> bool:
    if not hasattr(dist, "split_group"):
        return False
    default = dist.distributed_c10d._get_default_group()
    return getattr(default, "bound_device_id", None) is not None


async def create_groups(
    parent: dist.ProcessGroup,
    members: list[int],
    *,
    kind: str,
    is_world: bool,
    with_side_group: bool,
    high_priority: bool,
    backstop: float,
    seconds: float | None,
    parent_name: str,
    name: str = "",
    bind: Callable[[], None] = lambda: None,
    device: torch.device | None = None,
) -> Groups:
    """The child's group and side group on members; ``(None, None)`` on non-members.

    Raises:
        GangInitError: Creating failed, or a member's did not finish within ``seconds``.
    """
    is_member = parent.rank() in members
    global_ranks = [dist.get_global_rank(parent, r) for r in members]
    timeout = timedelta(seconds=backstop)
    options: Any = None
    if high_priority and kind == "nccl" and hasattr(dist, "ProcessGroupNCCL"):  # a CUDA build
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)

    def split() -> dist.ProcessGroup | None:  # rule 1
        group: dist.ProcessGroup | None = dist.split_group(
            parent_pg=parent, split_ranks=[members], timeout=timeout, pg_options=options
        )
        return group

    # Rule 2: the NCCL group is made connected; the side Gloo group has no device.
    nccl_device = device if device is not None and device.type == "cuda" else None

    def new_group(
        backend: str | None, pg_options: Any, *, members_only: bool = False
    ) -> dist.ProcessGroup | None:  # rule 2
        device_id = nccl_device if backend is None else None
        if is_world and not members_only:
            group = dist.new_group(
                global_ranks,
                timeout=timeout,
                backend=backend,
                pg_options=pg_options,
                device_id=device_id,
            )
            return group if is_member else None
        if not is_member:
            return None
        local: dist.ProcessGroup = dist.new_group(
            global_ranks,
            timeout=timeout,
            backend=backend,
            pg_options=pg_options,
            use_local_synchronization=True,
            device_id=device_id,
        )
        return local

    def create() -> Groups:
        group = split() if kind == "nccl" and _can_split() else new_group(None, options)
        # Rule 3: on NCCL, members only.
        side = new_group("gloo", None, members_only=kind == "nccl") if with_side_group else None
        return group, side

    stop_at = time.monotonic() + (seconds if seconds is not None else 1e9)

    def create_with_retry() -> Groups:  # rule 4
        bind()  # the gang's device, before c10d touches CUDA on this thread
        for attempt in retrying(RetryPolicy(), stop_at):
            with attempt:
                groups = call_c10d(create)
        if groups[0] is not None and name:
            _check_made_together(groups, name, stop_at)
        return groups

    try:
        made = await run_blocking(create_with_retry, name=f"create gang {members}", seconds=seconds)
    except Exception as exc:
        raise GangInitError(
            f"Creating a gang of ranks {members} of gang '{parent_name}' failed: {exc}"
        ) from exc
    group, side = made if made is not None else (None, None)
    if group is None and is_member:
        raise GangInitError(
            f"Creating a gang of ranks {members} of gang '{parent_name}' did not finish "
            f"within {seconds} s; every rank of '{parent_name}' must call create_gang "
            f"(or lane) with the same ranks, in the same order."
        )
    return group, side


def _check_made_together(groups: Groups, name: str, stop_at: float) -> None:
    """Rule 5: every member made the child under ``name``, or each destroys it and fails."""
    group = groups[0]
    assert group is not None
    store = dist.distributed_c10d._get_default_store()
    prefix = f"agang/children/{group.group_name}"
    keys = [f"{prefix}/{rank}" for rank in range(group.size())]
    store.set(keys[group.rank()], name)
    store.wait(keys, timedelta(seconds=max(0.1, stop_at - time.monotonic())))
    names = [store.get(key).decode() for key in keys]
    if all(other == name for other in names):
        return
    for made in groups:
        if made is not None:
            dist.destroy_process_group(made)
    said = "; ".join(f"rank {rank}: '{other}'" for rank, other in enumerate(names))
    raise ValueError(
        f"gang '{name}' was made by one call with other gangs on other ranks ({said}): "
        f"lanes and sub-gangs are made by a collective call, paired across ranks by call "
        f"order, so make them in the same order on every rank (for lanes, ask for each "
        f"one once at start-up, before tasks race to use them)"
    )
