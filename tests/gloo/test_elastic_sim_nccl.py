"""Elastic gangs over NCCL across processes, on the simulated NCCL (``AGANG_SIM_NCCL=1``):
the NCCL variants of ``test_elastic_faults``' kill and join scenarios.

Ranks are forked from one warm process (``tests/support/elasticrun.py``) around an
``agang store``, as there; each makes every epoch's group over the ``agang_sim_nccl``
backend, so its ops run agang's NCCL path. What differs from Gloo is NCCL's: a dead
peer's kernel waits for it, so a survivor in an op learns of a kill at its op deadline
(blame then names who does not answer), not from a dropped connection.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from elasticrun import Cluster, Control, Worker

pytestmark = pytest.mark.gloo

OP_TIMEOUT = 1.5
REFORM_TIMEOUT = 10.0
SETTINGS = {"timeout": 30, "op_timeout": OP_TIMEOUT, "reform_timeout": REFORM_TIMEOUT}
SIM = {"AGANG_SIM_NCCL": "1"}
FAILURES = ("CollectiveError", "GangBrokenError", "GangTimeoutError")


def _exact(workers: list[Worker], repeat: int = 3) -> list[int]:
    for worker in workers:
        worker.send("all_reduce", repeat=repeat, reform_after=False)
    events = [worker.event("reduced", "failed") for worker in workers]
    return [event.get("exact", event) for event in events]


@pytest.fixture(scope="module")
def story(control: Control) -> dict[str, Any]:
    """Three ranks on the simulation: one killed inside an all-reduce, the survivors
    reform, then a joiner is admitted."""
    found: dict[str, Any] = {}
    with Cluster(control, 3, env=SIM, min_size=2, **SETTINGS) as cluster:
        found["formed"] = cluster.epochs
        w0, w1, w2 = cluster.workers
        found["formed_exact"] = _exact([w0, w1, w2])
        # w2 dies inside an all-reduce that w0 and w1 issued (they wait for its part).
        for worker in (w0, w1, w2):
            worker.send("all_reduce", repeat=1000)
        for worker in (w0, w1, w2):
            worker.event("issued", timeout=10)
        killed = cluster.kill(w2)
        found["failures"] = [w.event("failed", timeout=OP_TIMEOUT + 15) for w in (w0, w1)]
        found["reformed"] = [w.event("epoch", "reform_failed", timeout=30) for w in (w0, w1)]
        found["kill_to_epoch"] = time.monotonic() - killed
        found["reformed_exact"] = _exact([w0, w1])
        # A replacement joins; the members admit it at their next reform.
        joiner = cluster.fork(2)
        cluster.join(joiner)
        for worker in (w0, w1):
            worker.send("reform", after_joiner=True)
        found["joined"] = [w.event("epoch", "reform_failed", timeout=30) for w in (w0, w1, joiner)]
        found["joined_exact"] = _exact([w0, w1, joiner])
    return found


def _where(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["what"], e.get("epoch"), e.get("rank"), e.get("size")) for e in events]


def test_an_elastic_gang_forms_on_the_simulation_with_nccl_as_its_backend(
    story: dict[str, Any],
) -> None:
    assert _where(story["formed"]) == [("epoch", 0, rank, 3) for rank in range(3)]
    assert {event["backend"] for event in story["formed"]} == {"nccl"}
    assert story["formed_exact"] == [3, 3, 3]


def test_a_rank_killed_mid_collective_leaves_every_survivor_told_and_reformed(
    story: dict[str, Any],
) -> None:
    for failure in story["failures"]:
        assert failure["what"] == "failed", failure
        assert failure["error"] in FAILURES, failure
    # The first to time out blames the dead rank; the other may learn of the reform first.
    blamed = [f.get("peers", {}).get("2", "") for f in story["failures"]]
    assert any(why.startswith("no answer (dead") for why in blamed), story["failures"]
    assert _where(story["reformed"]) == [("epoch", 1, 0, 2), ("epoch", 1, 1, 2)]
    assert {event["backend"] for event in story["reformed"]} == {"nccl"}
    # The op deadline (NCCL's kernel waits for the dead peer), blame, then the reform.
    assert story["kill_to_epoch"] < OP_TIMEOUT + 10, story["kill_to_epoch"]
    assert story["reformed_exact"] == [3, 3]
    print(f"sim NCCL: kill to epoch 1 in {story['kill_to_epoch']:.2f} s")


def test_a_joiner_is_admitted_to_the_next_epoch_and_sums_exactly(story: dict[str, Any]) -> None:
    assert _where(story["joined"]) == [("epoch", 2, rank, 3) for rank in range(3)]
    assert story["joined_exact"] == [3, 3, 3]
