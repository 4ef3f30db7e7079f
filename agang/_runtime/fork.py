"""What a child made by ``os.fork()`` inherits from a process using agang, and may do.

Rules:
1. A forked child has only the forking thread, and copies of the parent's sockets: the
   connections of every inherited communicator are shared with the parent. Anything the
   child sends on them, or shuts down, desynchronises or breaks the parent's gang. So
   the child never touches an inherited gang.
2. Every gang alive at the fork is marked in the child (``os.register_at_fork``) as
   closed and inherited: every use (an op, a lane, a sub-gang, waiting for room) raises
   ``GangInheritedError`` with no backend call, ``close()`` does nothing, and exit
   leaves it alone. The parent's gangs are unchanged.
3. agang's state in the child starts empty: the threads behind it exist only in the
   parent, so each module forgets its own in a hook of its own (open world gangs, the
   deadline timer, watchers, the threads joined at exit), with locks made anew (a parent
   thread may have held one at the fork). ``c10d_fork`` keeps c10d's groups from ever
   being freed in the child, and lets ``agang.init()`` there make a world of its own.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from agang._errors import GangInheritedError

# Every gang's engine: the ones alive at a fork are marked in the child (rule 2).
_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_pid = os.getpid()


def track(engine: Any) -> None:
    """Marks ``engine`` inherited in any child forked from now on (rule 2)."""
    _engines.add(engine)


def inherited_error(name: str, rank: int, size: int, parent: int) -> GangInheritedError:
    return GangInheritedError(
        f"Gang '{name}' (rank {rank} of {size}) was made in process {parent} before a "
        f"fork; this forked child (process {os.getpid()}) cannot use it: its connections "
        "are the parent's. Call agang.init() in the child if it needs a gang of its own."
    )


def _mark_inherited() -> None:
    global _pid
    parent, _pid = _pid, os.getpid()
    engines = list(_engines)
    _engines.clear()
    for engine in engines:
        # No lock: a parent thread may have held it at the fork. Only this thread runs.
        engine.broken = inherited_error(engine.name, engine.rank, engine.size, parent)
        engine.closed = True


os.register_at_fork(after_in_child=_mark_inherited)
