"""Aborting a c10d process group: making its running and queued work end now.

Rules:
1. NCCL: ``ProcessGroup.abort()`` aborts the communicator: its kernels exit with an
   error, each once this rank's device reaches it. The call returns only then, so it
   blocks while this rank's own earlier device work runs (an all-reduce queued behind
   1.8 s of the rank's own kernel made it take 1.46 s on an H100, NCCL 2.28); a peer
   that never comes does not make it wait.
2. Gloo: ``abort()`` and ``shutdown()`` leave running work alone (torch 2.13: an
   all_reduce that the peer never joins still runs after both, and dropping the group
   then waits in its destructor until the peer's connections close; see
   ``tests/gloo/test_abort.py``). What does end it is Gloo's own reaction to a timeout: a
   receive that times out makes Gloo close every pair of its context ("Application
   timeout caused pair closure"), and every op on those pairs then fails at once. So a
   Gloo group is aborted by posting, on each of its contexts, a receive that no peer
   will ever answer (a tag agang never sends on) and waiting a millisecond for it.
3. The peers see their connections to this rank close: their ops with it fail with a
   c10d error instead of hanging, which is what an abort is for.
4. Aborting never raises and, but for rule 1's wait for this rank's own device, never
   blocks for long: it is called on failure paths (on a thread of its own) and at close
   (off the event loop, which waits for it at most ``_CLOSE_SECONDS``). An
   already-closed pair makes the receive fail at once, which is fine.
5. A group is aborted once, by one thread at a time: two aborts of one Gloo group at
   once (a gang breaking on a timeout while it is being closed) sometimes left the
   first one's 1 ms wait blocked for good, and that thread then aborted the process
   when it woke during interpreter exit. Callers hold the group's ``Aborter``.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("agang.c10d")

# Tags agang never sends on: point-to-point ops use tag 0. Gloo picks a context by
# ``tag % number of contexts``, so consecutive tags from here reach every context.
_ABORT_TAG = 1 << 30
_ABORT_WAIT = timedelta(milliseconds=1)


class Aborter:
    """Aborts a gang's groups at most once, one caller at a time (rule 5)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def abort(self, groups: list[tuple[dist.ProcessGroup, str]]) -> None:
        """Aborts each ``(group, backend)`` unless this aborter already has; a caller
        that finds an abort under way waits for it to end."""
        with self._lock:
            if self._done:
                return
            self._done = True
            for group, backend in groups:
                abort_group(group, backend)


def abort_group(group: dist.ProcessGroup, backend: str) -> None:
    """Makes ``group``'s running and queued work fail now (rules 1 to 4)."""
    try:
        group.abort()  # NCCL: enough; Gloo (2.13): no effect on running work
    except Exception:
        log.debug("abort() of a %s group failed", backend, exc_info=True)
    if backend == "gloo":
        _close_gloo_pairs(group)


def _close_gloo_pairs(group: dist.ProcessGroup) -> None:
    size = group.size()
    if size < 2:
        return
    peer = (group.rank() + 1) % size
    try:
        options = group._get_backend(torch.device("cpu")).options
        num_contexts = len(getattr(options, "_devices", [None]))
    except Exception:
        num_contexts = 1
    for index in range(num_contexts):
        try:
            work = group.recv([torch.empty(1)], peer, _ABORT_TAG + index)
            work.wait(_ABORT_WAIT)
        except Exception:
            continue  # the expected timeout, or the pairs were closed already
        log.warning("A receive that no peer sends to completed while aborting a Gloo group.")
