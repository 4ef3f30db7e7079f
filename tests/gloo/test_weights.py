"""Weights to a changing fleet (``agang.WeightPublisher`` / ``agang.WeightSubscriber``)
with real processes on 127.0.0.1: an ``agang store``, servers that subscribe (each a
process of ``tests/support/weightserver.py``), and this test's process publishing on
asyncio, uvloop and trio.

Each server checks every version it receives against ``weightserver.model(version)``
and prints whether it matched exactly; the tests read those lines.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from storeutil import wait_until_stopped
from weightfleet import (
    PUSH_TIMEOUT,
    RECOVERY,
    SLACK,
    START_SECONDS,
    open_publisher,
    push,
    push_until_delivered,
    serve,
    until_pending,
)
from weightserver import model

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]


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
        await until_pending(publisher, "late")
        report = await push(publisher, 3)
        assert report.delivered == ("late", "s0", "s1"), report
        assert sorted(publisher.subscribers) == ["late", "s0", "s1"]
        for server in [*first, late]:
            server.received(3)
    finally:
        await publisher.close()
    for server in [*first, late]:
        failed = server.event("failed")
        # A normal end, as a closed gang is: not a lost channel.
        assert failed["error"] == "GangClosedError", failed
        assert "closed the channel 'w'" in failed["message"], failed
        assert "lost" not in failed["message"], failed


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
        await until_pending(publisher, "s1")
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
        report = await push_until_delivered(publisher, 3, "s0")
        assert set(report.delivered) == {"s0", "s1"}, report
        os.kill(pids[0], signal.SIGKILL)
    finally:
        await publisher.close()


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
