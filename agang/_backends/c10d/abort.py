"""Aborting a c10d process group: making its running and queued work end now.

Rules:
1. NCCL: ``ProcessGroup.abort()`` aborts the communicator: its kernels exit with an
   error, each once this rank's device reaches it. The call returns only then, so it
   blocks while this rank's own earlier device work runs (an all-reduce queued behind
   1.8 s of the rank's own kernel made it take 1.46 s on an H100, NCCL 2.28); a peer
   that never comes does not make it wait.
2. Gloo (torch 2.13 and the Gloo it ships): ``abort()`` and ``shutdown()`` are c10d's
   empty defaults (``Backend::abort``), so running work goes on (an all_reduce that the
   peer never joins still runs after both, and dropping the group then waits in its
   destructor until the peer's connections close; see ``tests/gloo/test_abort.py``).
   What ends an op is the closing of a pair (connection) it has an op pending on:
   ``Pair::signalException`` fails every buffer with a write, send or receive pending
   on that pair, and every later op on it fails at once (``Pair::recv`` and
   ``Pair::send`` rethrow the pair's error). A pair closes when its connection fails
   (the peer died or closed it: "Connection closed by peer", "Read error"), and all
   pairs of a context close when a wait on one of its buffers times out
   (``UnboundBuffer::waitRecv`` calls ``Context::signalException``: "Application
   timeout caused pair closure"). So a Gloo group is aborted thus: on each context, a
   receive from each peer in turn (``rank+1``, ``rank+2``, ...; on a tag agang never
   sends on), each waited for a millisecond, until one times out. A pair closed
   already (its peer died or aborted first) refuses the receive at once and closes
   nothing else, so the next peer is tried: a receive from the next peer alone left
   the other pairs open. Measured on 3 and 4 ranks (loopback, 2 cores): this rank's
   pending all_reduce or broadcast that a rank never joins, recv from a live peer,
   and send to a live peer that never receives (4 B to 16 MB) all fail within 25 ms
   of the abort, also when the next rank was SIGKILLed or had aborted first.
   Two ops no abort ends. A ``recv_anysource`` that no send matched waits in its
   context's own list (``Context::recvFromAny``), which closing pairs does not touch;
   it ends only at its own timeout (the group's). agang never posts one. And a send
   caught mid-write (part of its bytes in the socket, the rest queued on the pair: a
   peer that stopped reading, or died, mid-transfer) is not failed when its pair
   closes (``tests/gloo/test_abort_stuck_send.py``): it too ends at its timeout. Its
   gang's release reports it failed and frees its memory
   (``agang._backends.c10d.completion`` rule 4); the group's destructor, on the
   closing thread, still waits for that timeout.
3. The peers see their connections to this rank close: those of their ops with an op
   pending on a pair with this rank fail with a c10d error instead of hanging, which is
   what an abort is for. An op of theirs that waits only on a third rank (a collective
   stuck at a rank that never joins) is not touched: it ends when that rank, or they,
   abort. Likewise a peer's death fails only this rank's ops pending on the pair to it
   (at once on loopback, where the closed socket is read); ops waiting on live pairs
   wait for the abort.
4. Aborting never raises and, but for rule 1's wait for this rank's own device, never
   blocks for long: it is called on failure paths (on a thread of its own) and at close
   (off the event loop, which waits for it at most ``_CLOSE_SECONDS``). Per context it
   posts at most ``size - 1`` receives, each refused at once or waited for
   ``_ABORT_WAIT`` (1 ms), and stops at the first that times out; the abort of a 3 or
   4 rank group took 10 to 35 ms in all (most of it closing the pairs).
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
    """Rule 2: on each context, a receive from each peer in turn until one times out
    (which closes every pair of the context); a closed pair refuses the receive at once."""
    size = group.size()
    if size < 2:
        return
    rank = group.rank()
    try:
        options = group._get_backend(torch.device("cpu")).options
        num_contexts = len(getattr(options, "_devices", [None]))
    except Exception:
        num_contexts = 1
    for index in range(num_contexts):
        for step in range(1, size):
            if _receive_times_out(group, (rank + step) % size, _ABORT_TAG + index):
                break  # every pair of this context is closed now


def _receive_times_out(group: dist.ProcessGroup, peer: int, tag: int) -> bool:
    """Posts a receive from ``peer`` that no one answers and waits ``_ABORT_WAIT`` for it:
    True once it timed out (Gloo then closed every pair of the context), False when the
    pair was closed already (the receive is refused, or fails, without closing others)."""
    try:
        work = group.recv([torch.empty(1)], peer, tag)
    except Exception:
        return False  # this pair is closed: its ops failed when it closed
    try:
        work.wait(_ABORT_WAIT)
    except Exception as error:
        return "Timed out" in str(error)  # else the pair closed meanwhile: try the next
    log.warning("A receive that no peer sends to completed while aborting a Gloo group.")
    return False
