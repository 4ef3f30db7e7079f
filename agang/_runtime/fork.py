"""What a child made by ``os.fork()`` inherits from a process using agang, and may do.

Rules:
1. A forked child has only the forking thread, and copies of the parent's sockets: the
   connections of every inherited communicator are shared with the parent. Anything the
   child sends on them, or shuts down, desynchronises or breaks the parent's gang. So
   the child never touches an inherited gang.
2. Every gang alive at the fork is marked in the child as closed and inherited
   (``Inheritable.mark_inherited``): every use (an op, a lane, a sub-gang, waiting for
   room) raises ``GangInheritedError`` with no backend call, ``close()`` does nothing,
   and exit leaves it alone. The parent's gangs are unchanged.
3. agang's state in the child starts empty: the threads behind it exist only in the
   parent, so each module forgets its own (open world gangs, the deadline timer,
   watchers, the threads joined at exit), with locks made anew (a parent thread may have
   held one at the fork). Modules register what they forget here, with
   ``on_fork_in_child``; this module alone calls ``os.register_at_fork``, and the hooks
   run in the order they were registered, after the gangs are marked (rule 2).
   ``agang._backends.c10d.fork`` keeps c10d's groups from ever being freed in the child,
   and lets ``agang.init()`` there make a world of its own.
4. A child forked inside a running asyncio loop inherits that loop, whose epoll
   instance and self-pipe (the socket other threads write to wake it) it shares with
   the parent's loop: when the child leaves through the loop's teardown (``sys.exit``
   inside ``asyncio.run``), closing the loop unregisters the self-pipe from the shared
   epoll, the parent's loop is no longer woken by its own threads, and its awaited ops
   end but their tasks wake only at the next timer, or never. So the child's loop gets
   an epoll instance and a self-pipe of its own at the fork (``_own_loop``), before
   anything else runs there. This reaches into asyncio's selector loop; uvloop (libuv)
   and trio keep their own state, and a child forked under them should leave with
   ``os._exit()`` rather than through the loop's teardown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from agang._errors import GangInheritedError

log = logging.getLogger("agang.runtime")


class Inheritable(Protocol):
    """A gang's engine, as a fork sees it."""

    name: str
    rank: int
    size: int

    def mark_inherited(self, error: GangInheritedError) -> None:
        """Marks the engine closed and unusable with ``error``, without its lock (a
        parent thread may have held it at the fork; only this thread runs)."""


# Every gang's engine: the ones alive at a fork are marked in the child (rule 2).
_engines: weakref.WeakSet[Inheritable] = weakref.WeakSet()
# What modules forget in a child, in registration order (rule 3).
_child_hooks: list[Callable[[], None]] = []
_pid = os.getpid()


def track(engine: Inheritable) -> None:
    """Marks ``engine`` inherited in any child forked from now on (rule 2)."""
    _engines.add(engine)


def on_fork_in_child(hook: Callable[[], None]) -> None:
    """Runs ``hook`` in every child forked from now on, after the gangs are marked
    (rule 3). It must not block or take a lock the parent may have held."""
    _child_hooks.append(hook)


def inherited_error(name: str, rank: int, size: int, parent: int) -> GangInheritedError:
    return GangInheritedError(
        f"Gang '{name}' (rank {rank} of {size}) was made in process {parent} before a "
        f"fork; this forked child (process {os.getpid()}) cannot use it: its connections "
        "are the parent's. Call agang.init() in the child if it needs a gang of its own."
    )


# The asyncio loop running on the forking thread, named in the parent just before a fork
# (rule 4), for the child; None otherwise.
_forking_loop: Any = None


def _before_fork() -> None:
    global _forking_loop
    _forking_loop = asyncio._get_running_loop()


def _after_fork_in_parent() -> None:
    global _forking_loop
    _forking_loop = None


def _own_loop() -> None:
    """Rule 4: the asyncio loop running on the forking thread, if any, gets its own
    epoll instance and self-pipe in this child; the parent's are left as they are."""
    # asyncio says no loop runs in a child (it checks the pid), but the one the fork
    # interrupted is there, and ``asyncio.run`` still closes it when the child leaves:
    # the parent named it just before the fork.
    loop = _forking_loop
    selector = getattr(loop, "_selector", None)
    if loop is None or not isinstance(selector, selectors.BaseSelector):
        return  # no loop, or not asyncio's selector loop (uvloop)
    try:
        fresh = type(selector)()
        for key in list(selector.get_map().values()):
            fresh.register(key.fileobj, key.events, key.data)
        loop._selector = fresh
        selector.close()  # this process's copy of the shared epoll instance
        loop._close_self_pipe()  # this process's copies of the self-pipe's sockets
        loop._make_self_pipe()
    except Exception:  # an asyncio that differs inside: the parent is as before rule 4
        log.debug("agang: the forked child's loop keeps the parent's selector.", exc_info=True)


def _in_child() -> None:
    global _pid, _forking_loop
    parent, _pid = _pid, os.getpid()
    _own_loop()
    _forking_loop = None
    engines = list(_engines)
    _engines.clear()
    for engine in engines:
        engine.mark_inherited(inherited_error(engine.name, engine.rank, engine.size, parent))
    for hook in _child_hooks:
        hook()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_in_child
)
