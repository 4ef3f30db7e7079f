"""The gang over a c10d process group (Gloo on CPU, NCCL on CUDA), made by ``agang.init``.

The c10d work is its backend's (``agang._backends.c10d.backend``). A process group still alive
at interpreter exit can abort the process ("terminate called without an active
exception", seen with raw c10d too once future callbacks were used), so the world gangs
still open are closed at exit (``agang._runtime.threads``, within its bound): their running work is
aborted, their threads end. They are held strongly until closed: c10d keeps the world
group registered whether or not the program still holds its gang, so a gang the program
dropped without closing must still be closed at exit.

One world gang is open at a time: ``init`` refuses a second one while it is
(``check_no_open_world``), as does the registration here, which two inits racing each
other would otherwise pass both. A forked child forgets the parent's open world gangs
(``agang._runtime.fork``).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from agang._backends.c10d.backend import C10dBackend
from agang._backends.c10d.fork import disown_groups
from agang._collective.gang import CollectiveGang
from agang._errors import GangClosedError, GangInitError
from agang._policy import GangPolicy
from agang._runtime import fork, threads

_open_world_gangs: list[ProcessGroupGang] = []
_registry_lock = threading.Lock()


def _close_open_gangs() -> None:
    for gang in [gang for gang in list(_open_world_gangs) if not gang.closed]:
        gang.close_sync()


def open_world_gang() -> ProcessGroupGang | None:
    """The world gang of this process, if one is open."""
    for gang in _open_world_gangs:
        if not gang.closed:
            return gang
    return None


def check_no_open_world() -> None:
    """Raises ``GangInitError`` naming the open world gang, if there is one."""
    gang = open_world_gang()
    if gang is not None:
        raise GangInitError(
            f"agang.init() was called while the world gang '{gang.name}' (rank "
            f"{gang.rank} of {gang.size}, {gang.backend}) is still open: one process "
            "has one world gang. Close it first, or keep using it."
        )


def _forget_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()  # a parent thread may have held it at the fork
    # Up at the fork: the world group is the parent's, and c10d must forget it here.
    up = any(
        gang._c10d_group() is not None and gang._registered_world for gang in _open_world_gangs
    )
    _open_world_gangs.clear()
    if up:
        disown_groups(forget_world=True)


threads.at_exit(close=_close_open_gangs)
fork.on_fork_in_child(_forget_in_child)


class ProcessGroupGang(CollectiveGang):
    """A gang backed by a c10d process group. Made by [`agang.init`][agang.init].

    Args:
        process_group: The group the gang's ops run on.
        device: Where the gang's tensors live.
        backend: ``"gloo"`` or ``"nccl"``.
        name: The gang's name, for messages and logs.
        policy: Timeouts, in-flight bounds and order checking.
        is_world: Whether ``process_group`` is the default (world) group.
        stream_ordered: NCCL: ``await`` means ordered before later work on the caller's
            stream, instead of finished on the device.
        order_group: The side Gloo group of order checks; required when the policy
            checks order.
        registered: Whether torch.distributed knows the group; False for a private
            world (``is_world`` over a group registered nowhere, as ``agang.ray`` forms
            it: the process's default group stays the user's).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        device: torch.device,
        backend: str,
        name: str,
        policy: GangPolicy,
        is_world: bool,
        stream_ordered: bool = False,
        order_group: dist.ProcessGroup | None = None,
        registered: bool = True,
    ) -> None:
        if policy.check_order and order_group is None:
            raise ValueError("`order_group` must be given when the policy checks order.")
        c10d = C10dBackend(
            process_group,
            device=device,
            kind=backend,
            name=name,
            is_world=is_world,
            stream_ordered=stream_ordered,
            order_group=order_group,
            registered=registered,
        )
        super().__init__(c10d, policy)
        self._registered_world = is_world and registered
        if is_world:
            with _registry_lock:
                check_no_open_world()
                # Closed ones are dropped here: one strong reference per open world gang.
                _open_world_gangs[:] = [g for g in _open_world_gangs if not g.closed]
                _open_world_gangs.append(self)

    def _c10d_group(self) -> dist.ProcessGroup | None:
        """The gang's c10d group, or None once released (sub-gangs are made by
        ``gang_over``, so every one has a ``C10dBackend``)."""
        backend = self._backend
        assert isinstance(backend, C10dBackend)
        return backend.process_group

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The c10d process group, for calling torch.distributed directly.

        Raises:
            GangClosedError: The gang was closed and its group destroyed.
        """
        group = self._c10d_group()
        if group is None:
            raise GangClosedError(f"Gang '{self.name}' is closed; its group is gone.")
        return group
