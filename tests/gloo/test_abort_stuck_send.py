"""A Gloo send caught mid-write outlives an abort, and a gang's close frees its memory
all the same (``agang._backends.c10d.completion`` rule 4), on two real Gloo ranks:
rank 1 (``tests/support/gloo_stuck_peer.py``) posts its side of a 64 MiB broadcast and
is stopped (or killed), so rank 0's bytes fill the socket and the rest wait on the pair.

Gloo fails a closing pair's pending ops but not a send that is partly written: neither
agang's abort nor the peer's death ends it, only c10d's own timeout. The bounds keep a
10x margin: an abort ends other work in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from storeutil import SUPPORT, Spawned

from agang import GangTimeoutError
from agang._backends.c10d.abort import abort_group
from agang._backends.c10d.backend import C10dBackend
from agang._collective.gang import gang_over
from agang._collective.process_group_gang import ProcessGroupGang
from agang._engine import busy
from agang._policy import make_policy

pytestmark = [pytest.mark.gloo, pytest.mark.timeout(120)]

BYTES = 64 * 2**20  # far above the socket buffers of loopback
SETTLE = 3.0  # far past what an abort takes to end other work (milliseconds)
#: Close frees the send's tensor within this (release waits 2 s for the aborted ops'
#: ends first): well before c10d's own timeout would end the send.
FREED_WITHIN = 5.0
#: c10d's own timeout for the send: what ends it at last (the group's destructor waits
#: for it), past ``SETTLE``, and past the deadline plus ``FREED_WITHIN``.
C10D_TIMEOUT = 9.0


def _pair(started: list[subprocess.Popen[str]], timeout: float) -> tuple[Any, Spawned]:
    """Rank 0's group (made here, with c10d timeout ``timeout``) and rank 1's process,
    its side of the broadcast posted."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 2, True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    peer = Spawned(started, [str(SUPPORT / "gloo_stuck_peer.py"), str(store.port), str(BYTES)])
    gloo = dist.ProcessGroupGloo(store, 0, 2, timedelta(seconds=timeout))
    assert peer.out.next(60.0) == "posted"
    time.sleep(0.3)  # its notice that it receives reaches this rank
    return gloo, peer


@pytest.mark.parametrize("peer_fate", ["stopped", "killed"])
def test_gloo_keeps_a_send_caught_mid_write_through_an_abort(
    started: list[subprocess.Popen[str]], peer_fate: str
) -> None:
    group, peer = _pair(started, timeout=C10D_TIMEOUT)
    group.set_timeout(timedelta(seconds=SETTLE + 2.0))  # what ends the send at last
    os.kill(peer.process.pid, signal.SIGSTOP)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([torch.ones(BYTES // 4)], options)
    time.sleep(0.5)
    assert not work.is_completed()  # the peer reads nothing: the send waits mid-write
    if peer_fate == "killed":
        os.kill(peer.process.pid, signal.SIGKILL)
    abort_group(group, "gloo")
    time.sleep(SETTLE)
    assert not work.is_completed(), "Gloo now ends it: completion's rule 4 may go"
    # c10d's timeout ends it: the group is freed here, not waited for at its destructor.
    with pytest.raises(RuntimeError, match="Timed out"):
        work.wait()


def test_a_gang_closed_after_the_abort_frees_the_memory_of_a_send_caught_mid_write(
    started: list[subprocess.Popen[str]],
) -> None:
    """Its deadline aborts the gang; close reports the send failed and frees its tensor
    within its bound, while the group's destructor waits (on the closing thread) for
    c10d's timeout (set to ``C10D_TIMEOUT`` here, under the gang's backstop of 30 s or
    more), and ends then."""
    gloo, peer = _pair(started, timeout=C10D_TIMEOUT)
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)  # type: ignore[attr-defined]
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._set_group_name("stuck")  # type: ignore[arg-type]
    gang = gang_over(
        ProcessGroupGang,
        C10dBackend(
            group,
            device=torch.device("cpu"),
            kind="gloo",
            name="stuck",
            is_world=False,
            registered=False,
        ),
        make_policy(op_timeout=1.0, on_timeout="abort", check_order=False),
    )
    group.set_timeout(timedelta(seconds=C10D_TIMEOUT))  # under the backstop: see above
    del gloo, group  # the gang's close drops the last reference, on its thread
    before = busy.num_busy()
    os.kill(peer.process.pid, signal.SIGSTOP)
    handle = gang.broadcast(torch.ones(BYTES // 4), 0)
    with pytest.raises(GangTimeoutError):
        handle.wait(30.0)
    assert busy.num_busy() == before + 1  # the aborted send still holds its tensor
    closing = threading.Thread(target=gang.close_sync, name="test: close 'stuck'", daemon=True)
    started_at = time.monotonic()
    closing.start()
    while busy.num_busy() > before and time.monotonic() - started_at < FREED_WITHIN:
        time.sleep(0.05)
    freed_after = time.monotonic() - started_at
    waiting = "still waits for c10d" if closing.is_alive() else "is done"
    print(f"the tensor was free {freed_after:.2f} s into close; the close thread {waiting}")
    assert busy.num_busy() == before, "close left the aborted send's tensor busy"
    closing.join(3 * C10D_TIMEOUT)
    assert not closing.is_alive(), "the group's destructor outlived c10d's timeout"
