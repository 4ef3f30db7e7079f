"""A frozen store never delays a deadline (hardening, finding 5).

When an op's deadline passes, agang asks the peers, through the store, where they stand
(the blame; with order checking on, an op whose peer never issued it is still in its
order check then). When the store's host is stopped (rank 0 hosting the store, as under SLURM or a
hand launch), that question used to block until the store client's own timeout: the
survivor got ``CollectiveError`` after 37.5 s instead of ``GangTimeoutError`` at its 5 s
deadline. Here the store lives in a process of its own that the test stops, so the
ranks' communicator is unaffected and only the store is frozen.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from netutil import rank_env
from storeutil import wait_until_stopped

pytestmark = pytest.mark.gloo

DEADLINE = 1.0

_STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def _rank(rank: int, port: int, stopped: Any, results: Any) -> None:
    import torch

    import agang

    env = rank_env(rank, port, agent_store=True)
    gang = agang.init_sync(env=env, in_process=False, timeout=60, op_timeout=30, check_order=True)
    gang.all_reduce(torch.ones(1)).wait(timeout=30)
    results.put(("ready", rank))
    if not stopped.wait(timeout=30):
        results.put(("error", "the store was never stopped"))
        return
    if rank == 1:
        time.sleep(4.0)  # never issues the op; past rank 0's deadline and census
        return
    started = time.monotonic()
    try:
        gang.all_reduce(torch.ones(1), timeout=DEADLINE).wait(timeout=60)
        results.put(("result", "no error", 0.0, ""))
    except agang.GangError as error:
        results.put(("result", type(error).__name__, time.monotonic() - started, str(error)))


def test_blame_answers_within_its_bound_when_the_store_host_is_stopped() -> None:
    store = subprocess.Popen(
        [sys.executable, "-c", _STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    context = multiprocessing.get_context("spawn")
    ranks: list[Any] = []
    try:
        assert store.stdout is not None
        port = int(store.stdout.readline())
        stopped = context.Event()
        results = context.Queue()
        ranks = [context.Process(target=_rank, args=(r, port, stopped, results)) for r in range(2)]
        for process in ranks:
            process.start()
        assert {results.get(timeout=90) for _ in range(2)} == {("ready", 0), ("ready", 1)}
        os.kill(store.pid, signal.SIGSTOP)
        try:
            wait_until_stopped(store.pid)
            stopped.set()
            report = results.get(timeout=20)  # the old behaviour: nothing for 37 s
        finally:
            os.kill(store.pid, signal.SIGCONT)
        _, kind, elapsed, message = report
        assert kind == "GangTimeoutError", message
        assert DEADLINE <= elapsed < DEADLINE + 3.0
        assert "peers could not be asked" in message
        assert "did not answer within 0.5 s" in message
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        if store.stdin is not None:
            store.stdin.close()
        store.wait(timeout=30)
