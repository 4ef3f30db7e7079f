"""The NCCL settings agang makes before a process group exists, and why.

c10d reads these from the environment when the group is made. agang sets each one only
when the user has not, and logs it; ``agang doctor`` reports them.

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: on a failed or timed-out op, c10d aborts the
  communicator and keeps the process (1 and 3 kill it), so an agang deadline is
  survivable and the gang can report ``GangTimeoutError``.
- ``TORCH_NCCL_ENABLE_MONITORING=0``: the default group's heartbeat monitor kills every
  rank (SIGABRT) some minutes after any c10d-side timeout or error was signalled, whatever
  the error-handling mode. agang's own deadlines fail and abort the gang instead.
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: no flight-recorder dump signal to every rank on a
  c10d-side timeout (the first step towards that kill); agang's ``GangTimeoutError``
  carries its own flight recorder.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

log = logging.getLogger("agang")

#: Name -> (agang's value, why), in the order they are applied.
NCCL_SETTINGS: dict[str, tuple[str, str]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("2", "survive a timeout in-process"),
    "TORCH_NCCL_ENABLE_MONITORING": (
        "0",
        "agang's deadlines replace the heartbeat monitor, which kills the process",
    ),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": ("0", "agang's timeout errors carry the flight recorder"),
}


def apply_nccl_settings(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Sets every NCCL setting the user left unset; returns what it set."""
    made = {}
    for name, (value, why) in NCCL_SETTINGS.items():
        if name not in environ:
            environ[name] = value
            made[name] = value
            log.info("agang: set %s=%s (%s).", name, value, why)
    return made
