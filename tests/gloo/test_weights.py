"""Weights to a changing fleet (``agang.WeightPublisher`` / ``agang.WeightSubscriber``)
with real processes on 127.0.0.1: an ``agang store``, servers that subscribe (each a
process of ``tests/support/weightserver.py``), and this test's process publishing on
asyncio, uvloop and trio.

Each server checks every version it receives against ``weightserver.model(version)``
and prints whether it matched exactly; the tests read those lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from storeutil import SUPPORT, Spawned, Store, wait_until_stopped
from weightserver import model

from agang._errors import GangError
from agang._weights.publisher import WeightPublisher
from agang._weights.report import PushReport
from agang._weights.subscriber import WeightSubscriber

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]

HOST = socket.gethostname()
PUSH_TIMEOUT = 2.0
#: The recovery the publisher promises after a deadline, and this machine's slack.
RECOVERY = 4.0
SLACK = 1.5
START_SECONDS = 60.0
#: A push admits the subscribers registered a publisher's beat (0.2 s) before it.
ADMISSION = 0.5  # a process's start (torch's import) on a loaded 2-core machine


class Server(Spawned):
    """One weightserver process, its stdout as JSON events."""

    def __init__(self, started: list[subprocess.Popen[str]], *arguments: str) -> None:
        super().__init__(started, [str(SUPPORT / "weightserver.py"), *arguments], stdin=True)

    def event(self, *kinds: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.out.next(left)
            except AssertionError:
                break
            if line.startswith("{"):
                event: dict[str, Any] = json.loads(line)
                if event["event"] in kinds:
                    return event
        raise AssertionError(
            f"no {kinds} event within {timeout} s; stdout: {self.out.seen[-10:]}; "
            f"stderr: {self.err.rest(1)[-20:]}"
        )

    def opened(self) -> int:
        event = self.event("opened", "refused", timeout=START_SECONDS)
        assert event["event"] == "opened", event
        return int(event["pid"])

    def received(self, version: int) -> None:
        event = self.event("received", "failed")
        assert event == {"event": "received", "version": version, "exact": True}, event


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The processes a test starts; each is ended by its pid at the end."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.fixture
def store(started: list[subprocess.Popen[str]]) -> str:
    server = Store(started, "--port", "0", "--quiet")
    return server.out.next(START_SECONDS).split()[-1]


def serve(started: list[subprocess.Popen[str]], store: str, name: str, *extra: str) -> Server:
    return Server(started, "serve", store, "w", name, *extra)


async def push(publisher: WeightPublisher, version: int, **kwargs: Any) -> PushReport:
    for name, value in model(version).items():
        publisher._buckets._tensors[list(model(0)).index(name)].copy_(value)
    return await publisher.push(version, **kwargs)


async def open_publisher(store: str) -> WeightPublisher:
    return await WeightPublisher.open(model(0), store=store, channel="w", timeout=20.0)


async def test_every_push_is_exact_and_a_joiner_gets_the_next_push_in_full(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        first = [serve(started, store, f"s{i}") for i in range(2)]
        for server in first:
            server.opened()
        assert (await push(publisher, 1)).delivered == ("s0", "s1")
        for server in first:
            server.received(1)
        report = await push(publisher, 2)
        assert report.delivered == ("s0", "s1"), report
        assert report.dropped == {}, report
        assert report.bytes == sum(t.numel() * t.element_size() for t in model(0).values())
        for server in first:
            server.received(2)
        late = serve(started, store, "late", "--in-place")
        late.opened()  # opened between pushes: admitted at the next one, in full
        await anyio.sleep(ADMISSION)
        report = await push(publisher, 3)
        assert report.delivered == ("late", "s0", "s1"), report
        assert sorted(publisher.subscribers) == ["late", "s0", "s1"]
        for server in [*first, late]:
            server.received(3)
    finally:
        await publisher.close()
    for server in [*first, late]:
        failed = server.event("failed")
        assert "closed the channel" in failed["message"], failed


async def test_a_server_killed_mid_push_is_dropped_and_a_reopened_one_admitted_again(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        servers = [serve(started, store, f"s{i}") for i in range(3)]
        pids = [server.opened() for server in servers]
        assert (await push(publisher, 1)).delivered == ("s0", "s1", "s2")
        for server in (servers[0], servers[2]):
            server.received(1)  # before the next push, which would overwrite it untaken
        # Killed as the push begins: a 0.3 MB push takes a few ms, too short to aim at.
        os.kill(pids[1], signal.SIGKILL)
        report = await push(publisher, 2, timeout=PUSH_TIMEOUT)
        print(f"SIGKILL mid-push: {report}")
        assert set(report.dropped) == {"s1"}, report
        assert report.dropped["s1"].startswith("no answer (dead, stopped"), report
        assert report.delivered == ("s0", "s2"), report
        assert report.seconds < PUSH_TIMEOUT + RECOVERY + SLACK, report
        for server in (servers[0], servers[2]):
            server.received(2)
        again = serve(started, store, "s1")  # the server restarted, under its name
        again.opened()
        await anyio.sleep(ADMISSION)
        report = await push(publisher, 3)
        assert report.delivered == ("s0", "s1", "s2"), report
        assert report.dropped == {}, report
        for server in (servers[0], servers[2], again):
            server.received(3)
    finally:
        await publisher.close()


async def test_a_server_stopped_mid_push_is_dropped_in_time_and_admitted_when_it_wakes(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        servers = [serve(started, store, f"s{i}") for i in range(2)]
        pids = [server.opened() for server in servers]
        assert (await push(publisher, 1)).delivered == ("s0", "s1")
        # Taken before the next push: a server whose application takes a version only
        # after the next one arrived gets the newer one (receive returns the newest).
        servers[1].received(1)
        os.kill(pids[0], signal.SIGSTOP)  # wedged as the push comes: it never confirms
        wait_until_stopped(pids[0])
        report = await push(publisher, 2, timeout=PUSH_TIMEOUT)
        print(f"SIGSTOP mid-push: {report}")
        assert set(report.dropped) == {"s0"}, report
        assert report.dropped["s0"].startswith("no answer (dead, stopped"), report
        assert report.delivered == ("s1",), report
        assert report.seconds < PUSH_TIMEOUT + RECOVERY + SLACK, report
        servers[1].received(2)
        os.kill(pids[0], signal.SIGCONT)  # it finds itself dropped, and registers again
        servers[0].received(1)
        report = await _push_until_delivered(publisher, 3, "s0")
        assert set(report.delivered) == {"s0", "s1"}, report
        os.kill(pids[0], signal.SIGKILL)
    finally:
        await publisher.close()


async def _push_until_delivered(publisher: WeightPublisher, first: int, name: str) -> PushReport:
    """Pushes ``first``, ``first + 1``, ... until ``name`` gets one (its re-registration
    may land after a push began), at most 10 times in 20 s."""
    give_up_at = time.monotonic() + 20.0
    for version in range(first, first + 10):
        report = await push(publisher, version)
        if name in report.delivered or time.monotonic() > give_up_at:
            return report
        await anyio.sleep(0.3)
    return report


async def test_a_mismatched_plan_is_refused_at_open_and_the_others_go_on(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    publisher = await open_publisher(store)
    try:
        good = serve(started, store, "good")
        bad = serve(started, store, "bad", "--b-rows", "5")
        good.opened()
        refused = bad.event("refused", "opened", timeout=START_SECONDS)
        assert refused["error"] == "ValueError", refused
        message = refused["message"]
        assert "tensor #1 is 'b' float64[5, 3] here" in message, message
        assert "'b' float64[4, 3] in the publisher's plan" in message, message
        report = await push(publisher, 1)
        assert report.delivered == ("good",), report
        assert report.dropped == {}, report
        good.received(1)
    finally:
        await publisher.close()


async def test_the_publishers_death_fails_the_servers_naming_it(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    trainer = Server(started, "publish", store, "w")
    pid = trainer.opened()
    tensors = {k: v.clone().zero_() for k, v in model(0).items()}
    subscriber = await WeightSubscriber.open(tensors, store=store, channel="w", timeout=20.0)
    try:
        assert trainer.process.stdin is not None
        trainer.process.stdin.write("1\n")
        trainer.process.stdin.flush()
        assert await subscriber.receive(timeout=30.0) == 1
        assert all(torch.equal(tensors[k], v) for k, v in model(1).items())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(GangError) as failure:
            await subscriber.receive(timeout=30.0)
        took = time.monotonic() - killed_at
    finally:
        await subscriber.close()
    message = str(failure.value)
    print(f"{took:.2f} s after the publisher's SIGKILL: {message}")
    assert f"the publisher ({HOST}, pid {pid}) went away" in message, message
    assert took < 10.0, took
