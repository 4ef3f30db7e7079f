"""An elastic job's store stopped under it: its members fail in time, and say which
store.

The ``agang store`` is the one process an elastic job cannot lose (rule 1 of
``agang._setup.elastic``). Stopped (SIGSTOP), it held a 3 s reform until 5 s, and the
error did not name it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from elasticrun import Cluster, Control

pytestmark = pytest.mark.gloo

OP_TIMEOUT = 1.5
REFORM_TIMEOUT = 10.0
SETTINGS = {"timeout": 30, "op_timeout": OP_TIMEOUT, "reform_timeout": REFORM_TIMEOUT}


@pytest.fixture(scope="module")
def control() -> Iterator[Control]:
    control = Control()
    try:
        yield control
    finally:
        control.close()


def _wait_until_stopped(pid: int, seconds: float = 5.0) -> None:
    """Returns once ``pid`` is stopped: under load a SIGSTOP can take effect late."""
    give_up_at = time.monotonic() + seconds
    while time.monotonic() < give_up_at:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} was not stopped within {seconds} s")


@pytest.mark.parametrize("signum", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_reform_against_a_lost_store_fails_at_its_deadline_naming_it(
    control: Control, signum: int
) -> None:
    """A stopped store accepts the connection (the kernel does) and never answers: c10d's
    client waited past its own timeout, and the reform gave up 2 s after its 3 s
    deadline ("The reform did not finish before its deadline."). A killed one refuses
    it. Either way: at the deadline, naming the store."""
    deadline = 3.0
    with Cluster(control, 2, min_size=1, **SETTINGS) as cluster:
        w0, _ = cluster.workers
        address = f"127.0.0.1:{cluster.port}"
        store = cluster.store.process
        os.kill(store.pid, signum)
        try:
            if signum == signal.SIGSTOP:
                _wait_until_stopped(store.pid)
            else:
                store.wait(10)
            w0.send("reform", timeout=deadline)
            failed = w0.event("reform_failed", "epoch", timeout=30)
        finally:
            if signum == signal.SIGSTOP:
                os.kill(store.pid, signal.SIGCONT)
    assert failed["what"] == "reform_failed", failed
    assert failed["error"] == "GangInitError", failed
    assert address in failed["message"], failed
    assert "did not answer" in failed["message"] or "No store answered" in failed["message"]
    assert deadline <= failed["took"] < deadline + 1.5, failed
    name = signal.Signals(signum).name
    print(f"store {name}: reform failed at {failed['took']:.2f} s: {failed['message']}")
