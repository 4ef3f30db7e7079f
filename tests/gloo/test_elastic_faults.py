"""Faults an elastic gang must survive, on real Gloo processes around an ``agang store``.

Each scenario forms a gang of ranks forked from one warm process (``tests/support/elasticrun.py``,
whose ranks run ``tests/support/elasticworker.py``), drives them one command at a time, and
kills or stops ranks by pid at a chosen point: mid-collective, mid-64 MiB all-reduce,
mid-``recv``, the old rank 0, two at once, one during the reform itself, one stopped
(SIGSTOP) and woken after the others moved on. The survivors must get an error, reform
without the lost ranks, and compute exact sums in the new epoch; a reform short of
``min_size`` fails naming who is missing; 20 kill/reform/join cycles must not grow the
survivors' threads, fds or memory; and every survivor's event loop stays responsive
(a 10 ms ticker's lag under 20 ms at the p99) through all of it.
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import pytest
from elasticrun import Cluster, Control, Worker

import agang
from agang._setup import elastic as elastic_setup
from agang._setup import membership

pytestmark = pytest.mark.gloo

OP_TIMEOUT = 1.5
REFORM_TIMEOUT = 10.0
SETTINGS = {"timeout": 30, "op_timeout": OP_TIMEOUT, "reform_timeout": REFORM_TIMEOUT}
MIB64 = 16 << 20  # float32 elements in 64 MiB
FAILURES = ("CollectiveError", "GangBrokenError", "GangTimeoutError")
# A survivor's ticker's p99 over its life: 1-4 ms here alone (2026-11-28, the kills and
# stops tests, `pytest -n0 -s -k survivors_loops`), 30 ms once with two busy loops beside
# the suite; a loop that blocks on the store at each poll lags 100 ms and more per tick.
LAG_P99 = 0.100
CYCLES = 20
# c10d's timeout behind this test's op timeout (``backstop_for(1.5)``: 32.25 s), with a
# margin: how long an old epoch's group may outlive it (``_settle``).
SETTLE_SECONDS = 45.0


def _epoch(worker: Worker, timeout: float = REFORM_TIMEOUT + 10) -> dict[str, Any]:
    return worker.event("epoch", "reform_failed", timeout=timeout)


def _exact(workers: list[Worker], repeat: int = 3) -> list[int]:
    """How many of ``repeat`` all-reduces each of ``workers`` (a whole gang) got exact."""
    for worker in workers:
        worker.send("all_reduce", repeat=repeat, reform_after=False)
    events = [worker.event("reduced", "failed") for worker in workers]
    return [event.get("exact", event) for event in events]  # a failure shows itself


def _stats(workers: list[Worker]) -> list[dict[str, Any]]:
    for worker in workers:
        worker.send("stats")
    return [worker.event("stats") for worker in workers]


def _issue(workers: list[Worker], **arguments: Any) -> None:
    """Has ``workers`` start an all-reduce, and returns once each has issued it."""
    for worker in workers:
        worker.send("all_reduce", **arguments)
    for worker in workers:
        worker.event("issued")


# -- a rank killed mid-collective, mid-64 MiB, mid-recv; a joiner during a reform -------


@pytest.fixture(scope="module")
def kills(control: Control) -> dict[str, Any]:
    """Four ranks (min_size 2) lose one rank after another, each in another op, and
    admit a joiner that arrives while a reform is under way."""
    found: dict[str, Any] = {}
    with Cluster(control, 4, min_size=2, **SETTINGS) as cluster:
        w0, w1, w2, w3 = cluster.workers
        # 1. w1 dies inside an all-reduce (it issued it and waits for w3's part).
        _issue([w0, w1, w2])
        killed = cluster.kill(w1)
        w3.send("all_reduce")  # fails: at once, or once its peers' reform breaks its gang
        survivors = [w0, w2, w3]
        found["collective"] = _outcome(survivors, killed)
        found["collective_exact"] = _exact(survivors)
        # 2. A joiner arrives while w0 and w2 wait in a reform for w3 (alive, late).
        joiner = cluster.fork(0)
        for worker in (w0, w2):
            worker.send("reform")
        w3.send("reform", after_joiner=True)  # once the joiner waits, plus 0.5 s
        cluster.join(joiner)
        gang = [w0, w2, w3, joiner]
        found["joined"] = [_epoch(worker) for worker in gang]
        found["joined_exact"] = _exact(gang)
        # 3. w3 dies in the midst of 64 MiB all-reduces, after two have finished.
        for worker in gang:
            worker.send("all_reduce", numel=MIB64, repeat=50)
        for worker in gang:
            worker.event("issued", timeout=10)
        w3.event("done", timeout=30)
        w3.event("issued", timeout=30)
        killed = cluster.kill(w3)
        survivors = [w0, w2, joiner]
        found["big"] = _outcome(survivors, killed)
        found["big_exact"] = _exact(survivors)
        # 4. w0, rank 0, dies while w2 waits in a recv from it (the store lives on).
        w2.send("recv", source=0)
        w2.event("issued")
        killed = cluster.kill(w0)
        failure = w2.event("failed", timeout=OP_TIMEOUT + 10)  # its own, before any notice
        joiner.send("reform")  # an idle member is told by the training loop, not by an op
        survivors = [w2, joiner]
        found["recv"] = {**_outcome(survivors, killed, failing=0), "failures": [failure]}
        found["recv_exact"] = _exact(survivors)
        found["store_alive"] = cluster.store.process.poll() is None
        found["codes"] = [control.exit_status(w.pid) for w in (w1, w3, w0)]
        found["stats"] = _stats(survivors)
    return found


def _outcome(survivors: list[Worker], killed: float, failing: int | None = None) -> dict[str, Any]:
    """What the survivors saw after a kill at ``killed``: the errors of the first
    ``failing`` (those that were in an op; all by default), each one's new epoch, and
    the seconds from the kill to the last of those epochs."""
    in_op = survivors[: len(survivors) if failing is None else failing]
    failures = [worker.event("failed", timeout=OP_TIMEOUT + 10) for worker in in_op]
    epochs = [_epoch(worker) for worker in survivors]
    return {"failures": failures, "epochs": epochs, "kill_to_epoch": time.monotonic() - killed}


def _assert_reformed(outcome: dict[str, Any], epoch: int, size: int) -> None:
    for failure in outcome["failures"]:
        assert failure["what"] == "failed", failure
        assert failure["error"] in FAILURES, failure
    for rank, event in enumerate(outcome["epochs"]):
        assert (event["what"], event["epoch"], event["rank"], event["size"]) == (
            "epoch",
            epoch,
            rank,
            size,
        ), outcome
    # A kill is found out at once (a dropped connection, or a peer's reform notice), not
    # at the op deadline; 0.3 s of it is the ping of the dead rank.
    assert outcome["kill_to_epoch"] < OP_TIMEOUT + 5, outcome


def test_a_rank_killed_mid_collective_leaves_survivors_that_reform_and_sum_exactly(
    kills: dict[str, Any],
) -> None:
    _assert_reformed(kills["collective"], epoch=1, size=3)
    assert kills["collective_exact"] == [3, 3, 3]
    print(f"mid-collective: kill to epoch 1 in {kills['collective']['kill_to_epoch']:.2f} s")


def test_a_joiner_arriving_during_a_reform_is_admitted_by_it(kills: dict[str, Any]) -> None:
    joined = kills["joined"]
    assert [(e["what"], e["epoch"], e["rank"], e["size"]) for e in joined] == [
        ("epoch", 2, rank, 4) for rank in range(4)
    ], joined
    assert kills["joined_exact"] == [3, 3, 3, 3]


def test_a_rank_killed_mid_64_mib_all_reduce_leaves_survivors_that_reform(
    kills: dict[str, Any],
) -> None:
    _assert_reformed(kills["big"], epoch=3, size=3)
    assert kills["big_exact"] == [3, 3, 3]
    print(f"mid-64 MiB: kill to epoch 3 in {kills['big']['kill_to_epoch']:.2f} s")


def test_rank_0_killed_mid_recv_leaves_a_new_rank_0_on_the_store_that_lives_on(
    kills: dict[str, Any],
) -> None:
    outcome = kills["recv"]
    assert outcome["failures"][0]["error"] == "CollectiveError", outcome  # the recv's peer
    _assert_reformed(outcome, epoch=4, size=2)  # old rank 1 (w2) is rank 0 now
    assert kills["recv_exact"] == [3, 3]
    assert kills["store_alive"]
    assert kills["codes"] == [-signal.SIGKILL] * 3
    print(f"mid-recv, rank 0: kill to epoch 4 in {kills['recv']['kill_to_epoch']:.2f} s")


# -- a stopped rank, woken after the others moved on: a stale member of epoch 0 -------


@pytest.fixture(scope="module")
def stopped(control: Control) -> dict[str, Any]:
    """Three ranks; w1 is stopped (SIGSTOP) while the others start an all-reduce; it is
    woken (SIGCONT) once they formed epoch 1, uses its old gang, then tries to reform."""
    found: dict[str, Any] = {}
    with Cluster(control, 3, min_size=2, **SETTINGS) as cluster:
        w0, w1, w2 = cluster.workers
        cluster.kill(w1, signum=signal.SIGSTOP)
        stopped_at = time.monotonic()
        for worker in (w0, w2):
            worker.send("all_reduce")
        found["failures"] = [worker.event("failed", timeout=OP_TIMEOUT + 10) for worker in (w0, w2)]
        found["epochs"] = [_epoch(worker) for worker in (w0, w2)]
        found["stop_to_epoch"] = time.monotonic() - stopped_at
        cluster.kill(w1, signum=signal.SIGCONT)
        # Its next call, on the gang of epoch 0: refused, never run against epoch 1.
        w1.send("all_reduce", reform_after=False)
        found["woken"] = w1.event("failed", "reduced", timeout=OP_TIMEOUT + 10)
        found["woken_old"] = w1.ask("old", "old", previous=False)
        # The new gang meanwhile: exact, and still of two.
        found["exact_meanwhile"] = _exact([w0, w2], repeat=20)
        # A stale member's reform: epoch 1 is decided without it, so it waits as a joiner
        # and comes in at the members' next reform (epoch 2), never into epoch 1.
        w1.send("reform")
        found["noticed"] = [worker.ask("waiting", "waiting") for worker in (w0, w2)]
        found["exact_while_waiting"] = _exact([w0, w2], repeat=5)
        for worker in (w0, w2):
            worker.send("reform")
        found["readmitted"] = [_epoch(worker) for worker in (w0, w2, w1)]
        found["readmitted_exact"] = _exact([w0, w2, w1])
        found["stats"] = _stats([w0, w2])
    return found


def test_a_stopped_rank_is_blamed_at_the_deadline_and_left_out_of_the_reform(
    stopped: dict[str, Any],
) -> None:
    # Both ranks waited for w1 (rank 1) until the deadline; the first to time out blamed
    # it, and the other timed out too or was told of the first one's reform meanwhile.
    timed_out = [f for f in stopped["failures"] if f["error"] == "GangTimeoutError"]
    assert timed_out, stopped["failures"]
    for failure in timed_out:
        assert failure["peers"]["1"].startswith("no answer"), failure
    for failure in stopped["failures"]:
        assert failure["error"] in ("GangTimeoutError", "GangBrokenError"), failure
    assert [(e["what"], e["epoch"], e["rank"], e["size"]) for e in stopped["epochs"]] == [
        ("epoch", 1, 0, 2),
        ("epoch", 1, 1, 2),
    ]
    assert OP_TIMEOUT <= stopped["stop_to_epoch"] < OP_TIMEOUT + 5, stopped
    print(f"SIGSTOP: stop to epoch 1 in {stopped['stop_to_epoch']:.2f} s")


def test_a_woken_stale_member_is_refused_and_never_corrupts_the_new_gang(
    stopped: dict[str, Any],
) -> None:
    assert stopped["woken"]["what"] == "failed", stopped["woken"]
    # Its responder breaks the old gang once it reads the others' reform notice; a call
    # made before that (the process just woke: a race, lost once under CI's load) fails
    # on the old group's closed connections instead. Either way it fails, and every
    # call after it is refused.
    assert stopped["woken"]["error"] in ("GangBrokenError", "CollectiveError"), stopped["woken"]
    assert stopped["woken_old"]["outcomes"] == ["GangBrokenError"] * 5
    assert stopped["exact_meanwhile"] == [20, 20]
    assert [event["joiners"] for event in stopped["noticed"]] == [1, 1]
    assert stopped["exact_while_waiting"] == [5, 5]  # epoch 1 untouched while it waits
    readmitted = [(e["what"], e["epoch"], e["rank"], e["size"]) for e in stopped["readmitted"]]
    assert readmitted == [("epoch", 2, rank, 3) for rank in range(3)], readmitted
    assert stopped["readmitted_exact"] == [3, 3, 3]


def _a_joiner_waits_then_dies(cluster: Cluster) -> list[dict[str, Any]]:
    """A process joins the cluster's two members and waits; once both have noticed it
    (their events, returned), it is SIGKILLed before any reform admits it."""
    joiner = cluster.fork(0)
    cluster.join(joiner)
    noticed = [worker.ask("waiting", "waiting") for worker in cluster.workers[:2]]
    cluster.kill(joiner)
    return noticed


def test_a_joiner_that_dies_before_it_is_admitted_is_forgotten_by_the_reform(
    control: Control,
) -> None:
    # Counted for ever, it made every step boundary of the elastic guide's loop
    # (docs/guides/elastic.md) reform again.
    with Cluster(control, 2, min_size=2, **SETTINGS) as cluster:
        w0, w1 = cluster.workers
        noticed = _a_joiner_waits_then_dies(cluster)
        for worker in (w0, w1):
            worker.send("reform")
        epochs = [_epoch(worker) for worker in (w0, w1)]
        time.sleep(0.5)  # time for any joiner's notice to reach the new epoch
        counts = [worker.ask("count", "count") for worker in (w0, w1)]
        exact = _exact([w0, w1])
    assert [event["joiners"] for event in noticed] == [1, 1]
    assert [(e["what"], e["epoch"], e["size"]) for e in epochs] == [("epoch", 1, 2)] * 2
    assert [event["joiners"] for event in counts] == [0, 0]
    assert exact == [3, 3]


def test_a_joiner_killed_while_it_waits_is_not_waited_for_by_the_reforms_after(
    control: Control,
) -> None:
    # Still registered, it made every later reform's decision wait JOINER_GRACE (0.5 s)
    # for it, for ever: only a joiner that reached its own deadline withdrew.
    with Cluster(control, 2, min_size=2, **SETTINGS) as cluster:
        w0, w1 = cluster.workers
        _a_joiner_waits_then_dies(cluster)  # it registered, and told them
        # A member looks at the joiners every JOINER_LOOK: seen silent by then.
        time.sleep(membership.JOINER_STALE + elastic_setup.JOINER_LOOK + 0.2)
        epochs = []
        for _ in range(2):
            for worker in (w0, w1):
                worker.send("reform")
            epochs.append([_epoch(worker) for worker in (w0, w1)])
        exact = _exact([w0, w1])
    for epoch, events in enumerate(epochs, start=1):
        assert [(e["what"], e["epoch"], e["size"]) for e in events] == [("epoch", epoch, 2)] * 2
        # The member that came second found the other there: it decided at once (~1 ms
        # here; 0.5 s when it waited out the grace).
        decided_in = min(e["decided_in"] for e in events)
        assert decided_in < membership.JOINER_GRACE / 10, (epoch, events)
    assert exact == [3, 3]


# -- two ranks at once; a death inside the reform; too few left ------------------------


def test_two_ranks_killed_at_once_leave_survivors_that_reform(control: Control) -> None:
    with Cluster(control, 4, min_size=2, **SETTINGS) as cluster:
        w0, w1, w2, w3 = cluster.workers
        _issue([w1, w2])
        killed = cluster.kill(w1, w2)
        for worker in (w0, w3):
            worker.send("all_reduce")
        outcome = _outcome([w0, w3], killed)
        exact = _exact([w0, w3])
        stats = _stats([w0, w3])
    _assert_reformed(outcome, epoch=1, size=2)
    assert exact == [3, 3]
    _assert_responsive(stats)
    print(f"two at once: kill to epoch 1 in {outcome['kill_to_epoch']:.2f} s")


def test_a_death_during_the_reform_makes_it_form_the_next_epoch_in_time(
    control: Control,
) -> None:
    """w2 dies as it starts making epoch 1's group (after the members were decided): the
    others' reform forms epoch 2 without it, within the reform's deadline."""
    with Cluster(control, 4, {2: {"die_in_make_group": 1}}, min_size=2, **SETTINGS) as cluster:
        w0, w1, w2, w3 = cluster.workers
        _issue([w0, w1, w2])
        killed = cluster.kill(w1)
        w3.send("all_reduce")
        outcome = _outcome([w0, w3], killed)
        exact = _exact([w0, w3])
        stats = _stats([w0, w3])
        code = control.exit_status(w2.pid)
    _assert_reformed(outcome, epoch=2, size=2)
    assert code == -signal.SIGKILL  # it did die inside its reform
    assert exact == [3, 3]
    _assert_responsive(stats)
    print(f"death in reform: kill to epoch 2 in {outcome['kill_to_epoch']:.2f} s")


def test_a_member_whose_close_is_slow_is_waited_for(control: Control) -> None:
    """Closing the old gang may take seconds (aborting a communicator): a member that is
    still closing says so, and the others wait for it past the check-in window
    (GROUP_ATTEMPT_SECONDS) instead of leaving it out. (One that dies after its close
    stops saying so and is left out in time: the death-during-the-reform test.)"""
    slow = elastic_setup.GROUP_ATTEMPT_SECONDS + 2.0
    with Cluster(control, 3, {2: {"close_takes": slow}}, min_size=2, **SETTINGS) as cluster:
        workers = cluster.workers
        for worker in workers:
            worker.send("reform")
        epochs = [_epoch(worker) for worker in workers]
        exact = _exact(workers)
    assert [(e["what"], e["epoch"], e["size"]) for e in epochs] == [("epoch", 1, 3)] * 3
    assert exact == [3, 3, 3]


def test_a_reform_short_of_min_size_waits_for_a_replacement(control: Control) -> None:
    """min_size holds for the decision, and the decision waits for it: with a member
    killed and its replacement started at once but slow to come (a new process imports
    torch for seconds), the survivors wait for it within their deadline. They raised at
    once instead, 0.31 s into a 30 s deadline, and the replacement failed at its own."""
    settings = {**SETTINGS, "reform_timeout": 30.0}
    with Cluster(control, 3, min_size=3, **settings) as cluster:
        w0, w1, w2 = cluster.workers
        _issue([w2])
        cluster.kill(w2)
        replacement = cluster.fork(2)
        for worker in (w0, w1):
            worker.send("all_reduce")
        failures = [worker.event("failed", timeout=OP_TIMEOUT + 10) for worker in (w0, w1)]
        time.sleep(1.0)  # the survivors reform meanwhile, two of min_size=3
        cluster.join(replacement)
        epochs = [_epoch(worker, timeout=40) for worker in (w0, w1, replacement)]
        exact = _exact([w0, w1, replacement]) if epochs[0]["what"] == "epoch" else None
    for failure in failures:
        assert failure["error"] in FAILURES, failure
    found = [(e["what"], e.get("epoch"), e.get("rank"), e.get("size")) for e in epochs]
    assert found == [("epoch", 1, rank, 3) for rank in range(3)], epochs
    assert exact == [3, 3, 3]


def test_too_few_members_fail_the_reform_naming_who_is_missing(control: Control) -> None:
    with Cluster(control, 3, min_size=3, **{**SETTINGS, "reform_timeout": 2.0}) as cluster:
        w0, w1, w2 = cluster.workers
        _issue([w2])
        cluster.kill(w2)
        for worker in (w0, w1):
            worker.send("all_reduce")
        failed = [worker.event("reform_failed", "epoch", timeout=15) for worker in (w0, w1)]
        stats = _stats([w0, w1])
    for event in failed:
        assert event["what"] == "reform_failed", event
        assert event["error"] == "GangInitError", event
        assert "fewer than min_size=3" in event["message"], event
        assert f"pid {w2.pid}" in event["message"], event  # the missing rank, named
        # At its 2 s deadline: not sooner (it waits for members to come), nor much later.
        assert 2.0 <= event["took"] < 2.0 + 5.0, event
    _assert_responsive(stats)


def test_a_joiner_beyond_max_size_is_not_counted_and_is_told_why_it_waits(
    control: Control,
) -> None:
    """The elastic guide's loop (docs/guides/elastic.md) reforms when
    ``waiting_to_join() > 0``: a joiner that no reform can admit (the gang at max_size)
    made it reform at every step until the joiner's deadline, and the joiner then failed
    without saying why. It is not counted; it
    waits, logging why, until a member leaves (then a reform admits it) or until its
    deadline (then its error says why)."""
    with Cluster(control, 2, min_size=1, max_size=2, **SETTINGS) as cluster:
        w0, w1 = cluster.workers
        patient = cluster.fork(0)
        cluster.join(patient)
        noticed = [worker.ask("noticed", "noticed") for worker in (w0, w1)]
        hasty = cluster.fork(1)
        cluster.join(hasty, timeout=2)
        refused = hasty.event("init_failed", "epoch", timeout=15)
        counts = [worker.ask("count", "count") for worker in (w0, w1)]
        _issue([w1])
        cluster.kill(w1)  # a member leaves: the reform that follows admits the patient one
        w0.send("all_reduce")
        failure = w0.event("failed", timeout=OP_TIMEOUT + 10)
        epochs = [_epoch(worker) for worker in (w0, patient)]
        exact = _exact([w0, patient]) if epochs[1]["what"] == "epoch" else None
    assert [(e["noticed"], e["joiners"]) for e in noticed] == [(1, 0), (1, 0)], noticed
    assert [e["joiners"] for e in counts] == [0, 0], counts
    assert refused["what"] == "init_failed", refused
    assert refused["error"] == "GangInitError", refused
    assert "the gang is at max_size=2; " in refused["message"], refused
    assert 2.0 <= refused["took"] < 2.0 + 5.0, refused  # at its deadline
    assert any("max_size=2" in line for line in refused["logs"]), refused["logs"]
    assert failure["error"] in FAILURES, failure
    found = [(e["what"], e.get("epoch"), e.get("rank"), e.get("size")) for e in epochs]
    assert found == [("epoch", 1, 0, 2), ("epoch", 1, 1, 2)], epochs
    assert exact == [3, 3]


# -- 20 kill/reform/join cycles ----------------------------------------------------------


@pytest.mark.timeout(120 + SETTLE_SECONDS)
def test_kill_reform_join_cycles_leave_no_threads_fds_or_memory_behind(
    control: Control,
) -> None:
    """Each cycle: a joiner registers, the third rank is killed mid-all-reduce, and the
    reform that follows takes the joiner in its place. The two ranks that live through
    every cycle count their threads (the kernel's), open fds and RSS, after a garbage
    collection, at cycle 3 (once the first epochs' one-time costs are paid) and 20."""
    at: dict[int, list[dict[str, Any]]] = {}
    took: list[float] = []
    with Cluster(control, 3, min_size=2, **SETTINGS) as cluster:
        s0, s1, victim = cluster.workers
        joiner = cluster.fork(0)
        for cycle in range(1, CYCLES + 1):
            cluster.join(joiner)
            s0.ask("waiting", "waiting")
            _issue([s0, victim])  # the victim waits in it for s1's part
            killed = cluster.kill(victim)
            s1.send("all_reduce")
            following = cluster.fork(0)  # the next cycle's joiner, forked meanwhile
            outcome = _outcome([s0, s1], killed)
            _assert_reformed(outcome, epoch=cycle, size=3)
            assert _epoch(joiner)["rank"] == 2
            took.append(outcome["kill_to_epoch"])
            exact = _exact([s0, s1, joiner], repeat=1)
            assert exact == [1, 1, 1], (cycle, s0.seen[-3:], s1.seen[-3:], joiner.seen[-3:])
            if cycle in (3, CYCLES):
                at[cycle] = _stats([s0, s1])
            victim, joiner = joiner, following
        slowest = max(range(CYCLES), key=took.__getitem__)
        print(f"cycles: kill to epoch {min(took):.2f}..{took[slowest]:.2f} s (cycle {slowest + 1})")
        waited = _settle([s0, s1], at)
    for third, last in zip(at[3], at[CYCLES], strict=True):
        print(f"cycle 3 -> {CYCLES}: {_resources(third)} -> {_resources(last)}")
        assert _within(third, last), (waited, third, last)
    _assert_responsive(at[CYCLES])


def _within(third: dict[str, Any], last: dict[str, Any]) -> bool:
    """Whether ``last`` is within the tolerances of ``third``: a thread or two may be
    between ending and gone when counted (a stopped responder, a Gloo worker); an fd or
    a few likewise (a socket closing); RSS moves with the allocator's pools. A leak of
    one thread, one fd or 1 MiB per cycle adds 17 of each over cycles 3..20, above
    every tolerance."""
    return (
        last["threads"] <= third["threads"] + 2
        and last["fds"] <= third["fds"] + 4
        and last["rss"] <= third["rss"] + 12 * 2**20
    )


def _settle(workers: list[Worker], at: dict[int, list[dict[str, Any]]]) -> float:
    """Counts ``workers``' resources again while the last count is over the tolerances,
    for up to ``SETTLE_SECONDS``; returns how long that took.

    An epoch's group can outlive its epoch: ``close`` waits for its release at most
    ``_CLOSE_SECONDS`` (5 s), then lets the release end on its own thread, and a Gloo
    op that no abort ends (``agang._backends.c10d.abort``, rule 2) holds it until
    c10d's timeout (here ``backstop_for(1.5)``, 32.25 s). Its threads and sockets are
    then freed late, not leaked; a leak is still there when this wait ends. Seen once
    in CI (2026-11-29): a survivor's last count was 3 threads and 5 fds over (one
    3-rank Gloo group's worth) in a run whose slowest reform took 5.36 s."""
    started = time.monotonic()
    while not all(_within(t, last) for t, last in zip(at[3], at[CYCLES], strict=True)):
        if time.monotonic() - started > SETTLE_SECONDS:
            break
        time.sleep(1.0)
        at[CYCLES] = _stats(workers)
    return time.monotonic() - started


def _resources(stats: dict[str, Any]) -> str:
    return f"{stats['threads']} threads, {stats['fds']} fds, {stats['rss'] / 2**20:.0f} MiB"


# -- the loop stays responsive -----------------------------------------------------------


def _assert_responsive(stats: list[dict[str, Any]]) -> None:
    """Each survivor's 10 ms ticker woke within ``LAG_P99`` of its time at the p99, over
    its whole life (every fault it lived through)."""
    for each in stats:
        assert each["ticks"] > 20, each
        assert each["lag_p99"] < LAG_P99, (each, each["spikes"])


def test_the_survivors_loops_stay_responsive_through_kills_and_stops(
    kills: dict[str, Any], stopped: dict[str, Any]
) -> None:
    for each in kills["stats"] + stopped["stats"]:
        print(f"loop lag: p99 {each['lag_p99'] * 1e3:.1f} ms, max {each['lag_max'] * 1e3:.1f} ms")
    _assert_responsive(kills["stats"])
    _assert_responsive(stopped["stats"])


# -- a death notice ----------------------------------------------------------------------


def test_a_death_notice_fails_the_survivors_at_once_and_the_reform_leaves_the_member_out(
    control: Control,
) -> None:
    """A rank stopped (SIGSTOP: its connections stay open, so Gloo sees nothing) while the
    others wait on it in an all-reduce, with a 30 s deadline: a watcher reports it dead
    (``agang.report_death``). The survivors' ops fail at once, saying the watcher's why,
    not at their deadline; their reform leaves it out without pinging it."""
    settings = {**SETTINGS, "op_timeout": 30.0}
    with Cluster(control, 3, min_size=2, **settings) as cluster:
        w0, w1, w2 = cluster.workers
        cluster.kill(w1, signum=signal.SIGSTOP)
        _issue([w0, w2])
        reported_at = time.monotonic()
        told = agang.report_death_sync(
            f"127.0.0.1:{cluster.port}",
            f"{socket.gethostname()}, pid {w1.pid}",
            "stopped by the test",
        )
        failures = [worker.event("failed", timeout=20) for worker in (w0, w2)]
        failed_in = time.monotonic() - reported_at
        epochs = [_epoch(worker) for worker in (w0, w2)]
        exact = _exact([w0, w2])
    assert told >= 2  # every member of the epoch listens (the stopped one too)
    for failure in failures:
        assert failure["error"] == "GangBrokenError", failure
        assert "reported dead by" in failure["message"], failure
        assert "stopped by the test" in failure["message"], failure
    assert failed_in < 30.0 / 10, failed_in  # the deadline was 30 s
    assert [(e["what"], e["epoch"], e["size"]) for e in epochs] == [("epoch", 1, 2)] * 2
    assert exact == [3, 3]
    print(f"death notice: survivors failed {failed_in:.2f} s after it")
