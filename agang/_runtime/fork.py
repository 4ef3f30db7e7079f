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
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Protocol

from agang._errors import GangInheritedError


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


def _in_child() -> None:
    global _pid
    parent, _pid = _pid, os.getpid()
    engines = list(_engines)
    _engines.clear()
    for engine in engines:
        engine.mark_inherited(inherited_error(engine.name, engine.rank, engine.size, parent))
    for hook in _child_hooks:
        hook()


os.register_at_fork(after_in_child=_in_child)
