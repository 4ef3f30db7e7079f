"""One rank of a Gloo world in which rank 0 aborts its group (``tests/gloo/test_abort.py``).

Run as ``python gloo_abort_rank.py SCENARIO SIZE RANK HOST PORT``; the test hosts the
TCPStore. Prints one JSON line (its report) and leaves with ``os._exit`` (work that
stays pending would make the group's destructor wait). Times are wall-clock seconds
after rank 0's abort began (all ranks run on one host).

Scenarios (rank 1 is the *victim*, rank 0 the *aborter*, whose next rank is the victim):

- ``aborted``: rank 1 aborts its group first, so rank 0's pair to it is closed.
- ``killed``: the test SIGKILLs rank 1, so rank 0's pair to it is closed.
- ``absent``: rank 1 stays alive and joins nothing.

Then rank 0 posts work that waits on live peers only: a recv from the last rank that
it never sends, a send to rank 2 that it never receives (4 MB), a recv from any source
that no one answers, and in ``absent`` an all_reduce that the others but rank 1 join;
ranks 2 and up each post a recv from rank 0 that it never sends. Rank 0 then aborts
with ``abort_group``, and each rank says when (and how) each op ended.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from agang._backends.c10d.abort import abort_group

OBSERVE = 3.0  # how long after the abort each rank waits for its ops to end
SEND_BYTES = 4 << 20
GROUP_TIMEOUT = timedelta(seconds=120)  # Gloo's own timeout: far beyond the test


class Watched:
    """Works waited for on threads, each end noted with its wall-clock time."""

    def __init__(self) -> None:
        self.ends: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._keep: list[Any] = []

    def add(self, name: str, work: Any, tensor: torch.Tensor) -> None:
        self._keep.append((work, tensor))
        threading.Thread(target=self._wait, args=(name, work), daemon=True).start()

    def _wait(self, name: str, work: Any) -> None:
        try:
            work.wait()
            error = None
        except Exception as caught:
            error = str(caught)[:200]
        with self._lock:
            self.ends[name] = {"at": time.time(), "error": error}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return dict(self.ends)


def _wait_key(store: Any, key: str) -> float:
    store.wait([key], timedelta(seconds=30))
    return float(store.get(key).decode())


def main(scenario: str, size: int, rank: int, host: str, port: int) -> None:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, size, is_master=False, timeout=timedelta(seconds=30)
    )
    prefixed = dist.PrefixStore(scenario, store)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo", store=prefixed, rank=rank, world_size=size, timeout=GROUP_TIMEOUT
    )
    group = dist.group.WORLD
    assert group is not None
    dist.barrier()
    report: dict[str, Any] = {"rank": rank}
    watched = Watched()
    last = size - 1

    if rank == 1:
        if scenario == "killed":
            print("victim ready", flush=True)
            time.sleep(60)  # the test SIGKILLs it by its pid, then says so ("victim")
        if scenario == "aborted":
            abort_group(group, "gloo")
        store.set("victim", str(time.time()))
        _wait_key(store, "done")
        _exit(report)

    _wait_key(store, "victim")
    if rank == 0 and scenario != "absent":
        # The pair to rank 1 is closed once a receive from it fails (at once, or when
        # the closed connection is read).
        try:
            group.recv([torch.empty(1)], 1, 9).wait(timedelta(seconds=10))
        except Exception as error:
            report["pair_to_victim"] = str(error)[:200]
    if scenario == "absent" and rank != 1:
        tensor = torch.ones(1024)
        watched.add("all_reduce", group.allreduce([tensor]), tensor)
    if rank >= 2:
        tensor = torch.empty(4)
        watched.add("recv_from_aborter", group.recv([tensor], 0, 2), tensor)
        store.set(f"ready{rank}", "1")
    if rank == 0:
        tensor = torch.empty(4)
        watched.add("recv", group.recv([tensor], last, 0), tensor)
        tensor = torch.ones(SEND_BYTES // 4)
        watched.add("send", group.send([tensor], 2, 1), tensor)
        tensor = torch.empty(4)
        watched.add("recv_anysource", group.recv_anysource([tensor], 3), tensor)
        store.wait([f"ready{peer}" for peer in range(2, size)], timedelta(seconds=30))
        time.sleep(0.5)
        report["ended_before_abort"] = sorted(watched.snapshot())
        aborting_at = time.time()
        store.set("aborting", str(aborting_at))
        abort_group(group, "gloo")
        report["abort_took"] = time.time() - aborting_at
    aborting_at = _wait_key(store, "aborting")
    time.sleep(max(0.0, aborting_at + OBSERVE - time.time()))
    report["ends"] = {
        name: {"after": end["at"] - aborting_at, "error": end["error"]}
        for name, end in watched.snapshot().items()
    }
    if rank == 0:
        store.set("done", "1")
    _exit(report)


def _exit(report: dict[str, Any]) -> None:
    print(json.dumps(report), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
