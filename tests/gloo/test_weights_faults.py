"""Weights to a changing fleet, under faults (issue 24): a server cut off by its network
link mid-push, 10 join/kill cycles, the publisher's death and a new publisher, and a
join during a push. The servers are processes of ``tests/support/weightserver.py``
(``tests/support/weightfleet.py``); each checks every version it receives against
``weightserver.model(version)``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch
import torch.distributed as dist
from census import census
from netns import Cluster
from storeutil import Store, wait_until_stopped
from weightfleet import (
    HOST,
    PUSH_TIMEOUT,
    START_SECONDS,
    Server,
    open_publisher,
    push,
    push_until_delivered,
    serve,
)
from weightserver import model

from agang._errors import GangError
from agang._weights import housekeeping
from agang._weights.admission import RECOVERY_BYTES_PER_SECOND, RECOVERY_SECONDS
from agang._weights.publisher import WeightPublisher
from agang._weights.report import PushReport
from agang._weights.subscriber import WeightSubscriber

pytestmark = [pytest.mark.gloo, pytest.mark.timeout(120)]

# -- a server cut off by its link mid-push --------------------------------------------

CUT_BIG = 1024 * 1024  # floats of 'big': a 4 MiB push, 0.8 s to the far node at 40 Mbit/s
CUT_RATE = "40mbit"
CUT_TIMEOUT = 3.0
MARGIN = 5.0  # a noisy 2-core machine's slack over the publisher's bound


class Nodes:
    """A store and a publisher process on node 0 of a two-node cluster, and servers."""

    def __init__(
        self, cluster: Cluster, started: list[subprocess.Popen[str]], interfaces: bool
    ) -> None:
        self.cluster = cluster
        self.started = started
        self.interfaces = interfaces
        store = Store(
            started, "--host", cluster.nodes[0].address(), "--port", "0", "--quiet",
            via=cluster.via(0),
        )  # fmt: skip
        self.store = store.out.next(START_SECONDS).split()[-1]
        self.publisher = Server(started, "publish", self.store, "w", *self._big(), **self.on(0))
        self.publisher.opened()

    @staticmethod
    def _big() -> tuple[str, str]:
        return ("--big", str(CUT_BIG))

    def on(self, node: int) -> dict[str, Any]:
        """Where a process runs: node ``node``, naming its data interface to Gloo if
        ``interfaces``."""
        env = {"GLOO_SOCKET_IFNAME": f"data{node}"} if self.interfaces else {}
        return {"via": self.cluster.via(node), "env": env}

    def serve(self, node: int, name: str, *extra: str) -> Server:
        return serve(self.started, self.store, name, *self._big(), *extra, **self.on(node))

    def push(self, version: int) -> dict[str, Any]:
        """The publisher's report of ``version`` (a ``PushReport`` as JSON)."""
        self.publisher.send(f"{version} {CUT_TIMEOUT}")
        return self.pushed(version)

    def pushed(self, version: int) -> dict[str, Any]:
        event = self.publisher.event("pushed", timeout=CUT_TIMEOUT + RECOVERY_SECONDS + 60.0)
        assert event["version"] == version, event
        return event


@pytest.fixture
def nodes(netns: None, started: list[subprocess.Popen[str]]) -> Iterator[Nodes]:
    with Cluster(num_nodes=2) as cluster:
        yield Nodes(cluster, started, interfaces=True)


def test_a_server_cut_off_mid_push_is_dropped_in_time_and_admitted_again(nodes: Nodes) -> None:
    """Node 1's link goes down while version 2 is on its way there (its cable limited to
    40 Mbit/s, so the push lasts), and comes back after two more pushes. One loop: the
    publisher is a process of its own (asyncio). (An xfail until agang gave a failed
    round's held buckets new buffers, and a joiner that does not come its own bound.)"""
    cluster = nodes.cluster
    near = nodes.serve(0, "near")
    far = nodes.serve(1, "far", "--on-stdin")  # it reopens at each line, once it failed
    far.event("ready", timeout=START_SECONDS)
    far.send("open")
    near.opened()
    far.opened()
    shaped = cluster.limit_rate(1, CUT_RATE)
    first = nodes.push(1)
    assert first["delivered"] == ["far", "near"], first
    near.received(1)
    far.received(1)
    before = cluster.counters(1)["rx_bytes"]
    nodes.publisher.send(f"2 {CUT_TIMEOUT}")
    give_up_at = time.monotonic() + 30.0
    while not shaped and time.monotonic() < give_up_at:  # a quarter of the bytes came
        if cluster.counters(1)["rx_bytes"] > before + CUT_BIG:
            break
        time.sleep(0.005)
    cluster.link_down(1)
    cut_at = time.monotonic()
    report = nodes.pushed(2)
    print(f"node 1 cut off mid-push ({shaped or 'at 40 Mbit/s'}): {report}")
    print(f"the push returned {time.monotonic() - cut_at:.2f} s after the cut")
    bound = CUT_TIMEOUT + RECOVERY_SECONDS + 4 * CUT_BIG / RECOVERY_BYTES_PER_SECOND
    assert report["seconds"] < bound + MARGIN, report
    assert set(report["dropped"]) == {"far"}, report
    why = report["dropped"]["far"]
    assert why.startswith("no answer (dead, stopped"), why
    assert "version 2's round failed" in why, why
    assert report["delivered"] == ["near"], report
    near.received(2)
    report = nodes.push(3)
    assert report["delivered"] == ["near"], report
    assert report["dropped"] == {}, report
    near.received(3)
    cluster.link_up(1)
    up_at = time.monotonic()
    # Back on the network, it finds itself dropped and registers again; or its
    # subscriber failed meanwhile (the store out of reach), and it reopens.
    far.send("open")
    # Within 30 s: a store connection's retransmits back off while the link is down
    # (seconds apart after a cut of a few), and a loaded machine took more than the
    # 3-4 s that 10 pushes 0.3 s apart gave.
    back_by = time.monotonic() + 30.0
    for version in range(4, 104):
        report = nodes.push(version)
        assert "near" in report["delivered"], report
        near.received(version)
        if "far" in report["delivered"] or time.monotonic() > back_by:
            break
        time.sleep(0.3)
    print(f"{time.monotonic() - up_at:.2f} s after the link came back: {report}")
    print(f"far said {far.out.seen[-3:]}")
    assert report["delivered"] == ["far", "near"], report
    event = far.event("received", "failed")
    if event["event"] == "failed":  # its subscriber failed meanwhile, and it reopened
        print(f"far's first subscriber failed: {event}")
        far.opened()
        event = far.event("received", "failed")
    assert event == {"event": "received", "version": version, "exact": True}, event


def test_a_server_on_another_machine_is_admitted_without_an_interface_named(
    netns: None, started: list[subprocess.Popen[str]]
) -> None:
    """Nothing names Gloo's interface, as with ``agang.init`` across machines
    (``tests/gloo/test_many_hosts.py``): the weights must find it too, though each
    node's host name resolves to loopback there (an xfail until agang chose it)."""
    with Cluster(num_nodes=2) as cluster:
        nodes = Nodes(cluster, started, interfaces=False)
        far = nodes.serve(1, "far")
        far.opened()
        report = nodes.push(1)
        assert report["delivered"] == ["far"], report
        far.received(1)


# -- 10 join/kill cycles -----------------------------------------------------------------

# 10 cycles, 7 of them counted: a leak of a thread or an fd a cycle (a failed epoch's
# Gloo device holds one thread and 4 fds) is 7 over the count, against a margin of 2.
CYCLES = 10
WARM = 3  # the cycles before the first count: the first epochs' one-time costs
CYCLE_DEADLINE = 5.0  # the cycles' pushes' deadline (an admission takes 0.1-0.3 s)
#: The window the counts are watched over: a failed epoch's Gloo device (a thread, 4 fds)
#: lives until its gang's close ended, on a thread of its own after the push returned.
SETTLE = 3.0
ON_ASYNCIO = pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio")]
)


def _caught_up(server: Server, version: int) -> None:
    """Reads ``server``'s versions up to ``version``, each exact (its application may
    skip one: receive returns the newest)."""
    for _ in range(CYCLES * 3):
        event = server.event("received", "failed")
        assert event["event"] == "received", event
        assert event["exact"], event
        if event["version"] >= version:
            assert event["version"] == version, event
            return
    raise AssertionError(f"{version} never came")


async def _least(limit: dict[str, int] | None) -> tuple[dict[str, int], float]:
    """This process's least threads, fds and RSS seen over ``SETTLE`` seconds, sooner
    once all are within ``limit``; and how long it watched."""
    began = time.monotonic()
    least = census()
    while time.monotonic() - began < SETTLE:
        if limit is not None and all(least[k] <= limit[k] for k in limit):
            break
        await anyio.sleep(0.25)
        least = {k: min(v, least[k]) for k, v in census().items()}
    return least, time.monotonic() - began


def _margins(before: dict[str, int]) -> dict[str, int]:
    """The most of each count after the cycles: a thread or two may be ending when
    counted, an fd or two closing; RSS moves with the allocator (it grew 3.7 MiB over 17
    cycles here, ~0.2 MiB a cycle). A leak of one thread, fd or 2 MiB a cycle (14 MiB over
    the 7 counted) passes every bound."""
    return {
        "threads": before["threads"] + 2,
        "native_threads": before["native_threads"] + 2,
        "fds": before["fds"] + 2,
        "rss_kib": before["rss_kib"] + 10 * 1024,
    }


class Cycles:
    """A steady server, and servers forked one at a time (``weightserver.py fork``: 30
    torch imports would cost a minute of CPU here) to join and be killed."""

    def __init__(self, started: list[subprocess.Popen[str]], store: str) -> None:
        self.zygote = Server(started, "fork", store, "w")
        self.steady = serve(started, store, "steady")
        self.children: list[int] = []
        self.version = 0
        self.zygote.event("ready", timeout=START_SECONDS)
        self.steady.opened()

    async def cycle(self, publisher: WeightPublisher, name: str) -> PushReport:
        """``name`` opens, is pushed to until delivered, is SIGKILLed; the report of the
        push that dropped it."""
        self.zygote.send(name)
        self.children.append(self.zygote.event("forked")["pid"])
        self.zygote.opened()
        report = await push_until_delivered(publisher, self.version + 1, name)
        self.version = report.version
        assert set(report.delivered) == {name, "steady"}, report
        self.zygote.received(self.version)
        os.kill(self.children[-1], signal.SIGKILL)
        reaped = self.zygote.event("reaped")
        assert reaped["pid"] == self.children[-1], reaped
        self.version += 1
        report = await push(publisher, self.version, timeout=PUSH_TIMEOUT)
        assert report.delivered == ("steady",), report
        assert report.dropped[name].startswith("no answer (dead, stopped"), report
        _caught_up(self.steady, self.version)
        return report

    def end(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@ON_ASYNCIO
@pytest.mark.anyio
async def test_join_kill_cycles_leave_no_threads_fds_memory_or_store_keys_behind(
    started: list[subprocess.Popen[str]], store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cycle: a server process opens and is pushed to until delivered, is
    SIGKILLed, and the next push drops it; a steady server gets every push. The
    publisher's process (this one) counts its threads, fds and RSS after cycle 3 and 10:
    the least seen over ``SETTLE`` (a failed epoch's gang closes as its push returns).
    The store's keys and bytes are counted then too, with the publisher keeping the
    last ``_DROPS_KEPT`` drops: they must not grow either (they grew by 14 keys a cycle
    before the publisher deleted what no one reads again), and close leaves only the
    session's fixed keys. One loop (asyncio): the cost is the processes', and the
    publisher's loop part is the other tests' on three loops."""
    monkeypatch.setattr(housekeeping, "DROPS_KEPT", _DROPS_KEPT)
    publisher = await open_publisher(store, CYCLE_DEADLINE)
    cycles = Cycles(started, store)
    at: dict[int, dict[str, int]] = {}
    keys: dict[int, tuple[int, int]] = {}
    took: list[float] = []
    try:
        for cycle in range(1, CYCLES + 1):
            took.append((await cycles.cycle(publisher, f"c{cycle}")).seconds)
            if cycle in (WARM, CYCLES):
                first = census()
                limit = None if cycle == WARM else _margins(at[WARM])
                at[cycle], watched = await _least(limit)
                keys[cycle] = _store_keys(store)
                print(f"cycle {cycle}: {first}; least over {watched:.1f} s: {at[cycle]}")
                print(f"cycle {cycle}: the store holds {keys[cycle]} (keys, bytes)")
    finally:
        cycles.end()
        await publisher.close()
    closed = _store_keys(store)
    before, after = at[WARM], at[CYCLES]
    print(f"pushes that dropped the killed server: {min(took):.2f}..{max(took):.2f} s")
    print(f"cycle {WARM} -> {CYCLES}: {before} -> {after}")
    print(f"the store after close: {closed} (keys, bytes)")
    for name, most in _margins(before).items():
        assert after[name] <= most, (name, before, after)
    # Same keys (names differ by a pid and a number), bytes within a few digits' worth.
    assert keys[CYCLES][0] == keys[WARM][0], keys
    assert keys[CYCLES][1] <= keys[WARM][1] + 64, keys
    # What stays: the session's plan, publisher, beat, counts, epoch and closed, the
    # channel's session, and the beat of the steady server (killed, never closed).
    assert closed[0] <= 9, closed


_DROPS_KEPT = 2


def _store_keys(address: str) -> tuple[int, int]:
    """The keys the store at ``address`` holds, and their bytes (queues are not keys:
    the publisher pops its own, and drains a dropped server's mailbox)."""
    host, port = address.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    count = size = 0
    for name in client.list_keys():
        # A server deletes its own keys when it closes: one may go between list and read.
        if client.check([name]):
            with contextlib.suppress(dist.DistStoreError):
                size += len(client.get(name))
                count += 1
    return count, size


@ON_ASYNCIO
@pytest.mark.anyio
async def test_a_failed_epochs_gang_is_freed_when_the_push_returns(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    """A kill fails epoch 0; the push that drops the killed server closes epoch 0's
    gang (on a thread of its own, as it returns), and nothing keeps it (its engine, its
    group, its Gloo device) once that close ended, whatever its ops' deadline (20 s
    here). One loop (asyncio). (An xfail until a closed gang cancelled its deadline
    check, which had held the engine until the ops' deadline.)"""
    publisher = await open_publisher(store, 20.0)
    try:
        steady, victim = serve(started, store, "steady"), serve(started, store, "victim")
        steady.opened()
        victim.opened()
        assert (await push(publisher, 1)).delivered == ("steady", "victim")
        assert publisher._admission.gang is not None
        engine = weakref.ref(publisher._admission.gang._engine)  # epoch 0's, which the kill fails
        threads = census()["native_threads"]
        victim.kill()
        report = await push(publisher, 2)
        assert set(report.dropped) == {"victim"}, report
        assert report.epoch == 1, report
        for _ in range(50):  # 5 s, a quarter of the ops' deadline: the close's thread
            gc.collect()
            if engine() is None:
                break
            await anyio.sleep(0.1)
        print(f"threads: {threads} before the kill, {census()['native_threads']} after")
        assert engine() is None, "epoch 0's engine outlived its gang's close"
    finally:
        await publisher.close()


# -- the publisher's death, then a new publisher -------------------------------------


@pytest.mark.anyio
async def test_the_publishers_death_fails_the_servers_naming_it_and_they_reopen_to_the_next(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    """The trainer (a process) is SIGKILLed: a subscriber in this process (on each loop)
    and a server process fail, naming it, within 10 s. Then the trainer starts again
    (a new publisher on the same channel) and each reopens under its name and receives
    its pushes, exact."""
    trainer = Server(started, "publish", store, "w")
    server = serve(started, store, "s1", "--on-stdin")  # it reopens at each line
    restarted = Server(started, "publish", store, "w", "--on-stdin")  # imports meanwhile
    pid = trainer.opened()
    server.event("ready", timeout=START_SECONDS)
    server.send("open")
    tensors = {k: v.clone().zero_() for k, v in model(0).items()}
    subscriber = await WeightSubscriber.open(
        tensors, store=store, channel="w", name="s0", timeout=20.0
    )
    try:
        server.opened()
        trainer.send("1")
        assert await subscriber.receive(timeout=30.0) == 1
        assert all(torch.equal(tensors[k], v) for k, v in model(1).items())
        server.received(1)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(GangError) as failure:
            await subscriber.receive(timeout=30.0)
        took = time.monotonic() - killed_at
        failed = server.event("failed")
    finally:
        await subscriber.close()
    message = str(failure.value)
    print(f"{took:.2f} s after the publisher's SIGKILL: {message}")
    named = f"the publisher ({HOST}, pid {pid}) went away"
    assert named in message, message
    assert took < 10.0, took
    assert failed["error"] == "GangError", failed
    assert named in failed["message"], failed

    restarted.event("ready", timeout=START_SECONDS)
    restarted.send("open")
    restarted.opened()
    tensors = {k: v.clone().zero_() for k, v in model(0).items()}
    subscriber = await WeightSubscriber.open(
        tensors, store=store, channel="w", name="s0", timeout=20.0
    )
    try:
        server.send("open")
        server.opened()
        for version in range(1, 11):  # until both are admitted (they registered as it ran)
            restarted.send(str(version))
            pushed = restarted.event("pushed")
            if pushed["delivered"] == ["s0", "s1"]:
                break
        assert pushed["delivered"] == ["s0", "s1"], pushed
        first = pushed["version"]
        for version in (first, first + 1):
            if version > first:
                restarted.send(str(version))
                assert restarted.event("pushed")["delivered"] == ["s0", "s1"]
            assert await subscriber.receive(timeout=30.0) == version
            assert all(torch.equal(tensors[k], v) for k, v in model(version).items())
            server.received(version)
    finally:
        await subscriber.close()


# -- a join during a push ----------------------------------------------------------------


@pytest.mark.anyio
async def test_a_server_that_opens_during_a_push_gets_the_next_push_in_full(
    started: list[subprocess.Popen[str]], store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 2's round is held open (its one server stopped, then continued: a slow
    server, not a lost one, within the push's 30 s deadline); a server opens while it
    runs. The push under way delivers to its server only, exact and with no drop; the
    joiner is admitted at the next push and its first version is that one, whole."""
    publisher = await open_publisher(store)
    round_began = anyio.Event()
    run_round = publisher._round

    async def observed_round(version: int, deadline: float) -> tuple[set[str], Any]:
        round_began.set()
        return await run_round(version, deadline)

    monkeypatch.setattr(publisher, "_round", observed_round)
    try:
        steady = serve(started, store, "steady")
        joiner = serve(started, store, "joiner", "--on-stdin")
        pid = steady.opened()
        joiner.event("ready", timeout=START_SECONDS)
        assert (await push(publisher, 1)).delivered == ("steady",)
        steady.received(1)
        os.kill(pid, signal.SIGSTOP)
        wait_until_stopped(pid)
        round_began = anyio.Event()
        reports: list[PushReport] = []
        async with anyio.create_task_group() as tasks:

            async def push_2() -> None:
                reports.append(await push(publisher, 2, timeout=30.0))

            tasks.start_soon(push_2)
            with anyio.fail_after(10):
                await round_began.wait()
            joiner.send("open")
            await anyio.to_thread.run_sync(joiner.opened)  # the loop runs the push meanwhile
            assert not reports, reports  # the push was still under way when it opened
            os.kill(pid, signal.SIGCONT)
        report = reports[0]
        print(f"the push a server joined during: {report}")
        assert report.delivered == ("steady",), report
        assert report.dropped == {}, report
        steady.received(2)
        report = await push(publisher, 3)
        assert report.delivered == ("joiner", "steady"), report
        assert report.dropped == {}, report
        joiner.received(3)  # its first version
        steady.received(3)
    finally:
        os.kill(pid, signal.SIGCONT)
        await publisher.close()
