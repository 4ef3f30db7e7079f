"""``ProcessSimulation``: this process's simulated GPU, for a simulated NCCL across
processes.

Rules:
1. One per process, made by the first ``install``: one simulated device (its streams,
   events and watchdog: ``device``) and one rank's runtime on it, shared by every
   simulated communicator of the process, as one GPU is shared by every NCCL
   communicator of a rank.
2. ``install`` also registers the c10d backend ``agang_sim_nccl``
   (``c10d_group.SimNcclProcessGroup``), so ``init_process_group`` and ``new_group`` make
   simulated communicators. It is idempotent; the watchdog timeout of the first call holds.
3. A forked child forgets its parent's simulation (its device thread is the parent's
   alone) and installs its own when asked.
"""

from __future__ import annotations

import os
import threading

from agang._backends.sim_nccl import c10d_group
from agang._backends.sim_nccl.device import SimDevice
from agang._backends.sim_nccl.group import SimRuntime
from agang._runtime import fork

_lock = threading.Lock()
_current: ProcessSimulation | None = None


class ProcessSimulation:
    """This process's simulated device and its rank's runtime (rule 1).

    Args:
        watchdog_timeout: Seconds after which the simulated watchdog fails a pending op
            and aborts its communicator; None: the timeout c10d is given (agang's
            backstop).
    """

    def __init__(self, *, watchdog_timeout: float | None = None) -> None:
        self.device = SimDevice(watchdog_timeout=watchdog_timeout)
        rank = int(os.environ.get("RANK", "0") or 0)
        self.runtime = SimRuntime(self.device, rank)

    @staticmethod
    def current() -> ProcessSimulation | None:
        """The process's simulation, or None before ``install``."""
        return _current

    @staticmethod
    def install(*, watchdog_timeout: float | None = None) -> ProcessSimulation:
        """The process's simulation, made and registered with c10d at the first call
        (rules 1 and 2)."""
        global _current
        with _lock:
            if _current is None:
                _current = ProcessSimulation(watchdog_timeout=watchdog_timeout)
            c10d_group.register(_current.device, _current.runtime)
            return _current


def _forget_in_child() -> None:
    global _current, _lock
    _current = None
    _lock = threading.Lock()


fork.on_fork_in_child(_forget_in_child)
