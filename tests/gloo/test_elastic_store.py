"""An elastic job's store stopped or restarted under it: its members fail loudly, in
time, and say which store.

The ``agang store`` is the one process an elastic job cannot lose (rule 1 of
``agang._setup.elastic``). Restarted empty on the same port, it let a replacement form
an epoch 0 of its own while the old members trained on at theirs, unaware, their
responders gone: two jobs on one store. Stopped (SIGSTOP), it held a 3 s reform until
5 s, and the error did not name it.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from elasticrun import Cluster, Control
from storeutil import wait_until_stopped

from agang._setup import membership

pytestmark = pytest.mark.gloo

OP_TIMEOUT = 1.5
REFORM_TIMEOUT = 10.0
SETTINGS = {"timeout": 30, "op_timeout": OP_TIMEOUT, "reform_timeout": REFORM_TIMEOUT}
#: The replacement's own deadline: it waits for WORLD_SIZE processes until then, and
#: then (min_size 1) used to form a job of its own.
NEWCOMER_TIMEOUT = 20.0


def test_a_store_restarted_empty_fails_the_members_and_the_newcomer_loudly(
    control: Control,
) -> None:
    """The members' next look at the store (the step boundary's ``waiting_to_join``,
    an op, the reform) fails, naming the store and saying it lost the job; the
    replacement that came to the empty store fails too, long before its deadline,
    rather than form a second job. Before: the count read 0, the all-reduce succeeded
    (the two trained on), and the replacement formed a size-1 epoch 0 at its deadline."""
    with Cluster(control, 2, min_size=1, **SETTINGS) as cluster:
        w0, w1 = cluster.workers
        address = f"127.0.0.1:{cluster.port}"
        cluster.restart_store()
        newcomer = cluster.fork(1)  # a replacement, as its launcher would start it
        started = time.monotonic()
        cluster.join(newcomer, timeout=NEWCOMER_TIMEOUT)
        _wait_for_formation_0(cluster.port)  # it waits there for WORLD_SIZE processes
        counts = [worker.ask("count", "count") for worker in (w0, w1)]
        for count in counts:
            assert count.get("error") == "GangBrokenError", count
            assert f"store at {address}" in count["message"], count
        for worker in (w0, w1):
            worker.send("all_reduce")  # then reform, as a training loop does
        failures = [worker.event("failed", "reduced") for worker in (w0, w1)]
        for failure in failures:
            assert failure["what"] == "failed", failure
            assert failure["error"] == "GangBrokenError", failure
            assert f"store at {address}" in failure["message"], failure
        reforms = [worker.event("reform_failed", "epoch") for worker in (w0, w1)]
        refused = newcomer.event("init_failed", "epoch", timeout=NEWCOMER_TIMEOUT + 10)
        refused_after = time.monotonic() - started
    print(f"the members' first failure: {failures[0]['message']}")
    print(f"their reform: {reforms[0]['message']}")
    print(f"the replacement, {refused_after:.2f} s after it started: {refused['message']}")
    for reform in reforms:
        assert reform["what"] == "reform_failed", reform
        assert reform["error"] == "GangInitError", reform
        assert f"The store at {address} no longer holds elastic job " in reform["message"]
        assert "(restarted empty?)" in reform["message"], reform
    assert refused["what"] == "init_failed", refused
    assert refused["error"] == "GangInitError", refused
    assert "lost the state of a running elastic job" in refused["message"], refused
    assert address in refused["message"], refused
    assert refused_after < NEWCOMER_TIMEOUT / 2, refused_after  # told, not at its deadline


def _wait_for_formation_0(port: int, seconds: float = 15.0) -> None:
    """Returns once a process arrived at formation 0 on the store at ``port``."""
    client = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=seconds)
    )
    give_up_at = time.monotonic() + seconds
    while not client.check([membership.epoch_key(0, "arrived")]):
        assert time.monotonic() < give_up_at, f"nobody came to formation 0 in {seconds} s"
        time.sleep(0.01)


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
                wait_until_stopped(store.pid)
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
