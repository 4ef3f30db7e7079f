"""c10d's own timeout, kept behind agang's deadlines (``C10dBackend.allow_timeout``).

c10d fails an op, and on NCCL may end the process, when its process-group timeout
passes; agang's deadline must always fire first, so the group's timeout is raised past
the longest deadline asked for, by the rule below.
"""

from __future__ import annotations

# c10d's deadline sits this far behind agang's, so agang's always fires first.
_BACKSTOP_FACTOR = 1.5
_BACKSTOP_MARGIN = 30.0
# Behind an op with no agang deadline, c10d's timeout must not fire either: when it does,
# NCCL's watchdog fails the op and signals every rank to dump its flight recorder, and
# the default group's heartbeat monitor then kills the process minutes later whatever
# the error handling mode. So "no deadline" lifts it to what is never reached in practice.
_NO_DEADLINE_BACKSTOP = 30 * 86400.0


def backstop_for(timeout: float | None) -> float:
    """The c10d timeout to use behind an agang deadline of ``timeout`` seconds (None: no
    deadline)."""
    if timeout is None:
        return _NO_DEADLINE_BACKSTOP
    return max(timeout * _BACKSTOP_FACTOR + _BACKSTOP_MARGIN, _BACKSTOP_MARGIN)
