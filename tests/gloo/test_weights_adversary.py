"""What clusters do to a weights channel (issue 32): a second publisher, a server
replaced under its name or closed just before a push, tied weights, clocks that differ
between hosts, a paused server, a stalled or lost store.

Each test here failed on f239306, before the channel was rebuilt on the membership
layer; the failure each one caught is in its docstring (``test_weights_cancel.py`` has
what asyncio programs do to it: cancellation). The trainer and most servers run in this
process (each server's rounds on a thread of its own, as always); a server whose clock
or process state a test changes is a process of ``tests/support/weightserver.py``.

These tests attack the cluster (processes, clocks, the store), not the event loop: each
runs once, on asyncio, where the rest of the suite runs every async test on asyncio,
uvloop and trio. They wait for seconds each (a pause of 16 s, a stall of 10 s), and three
loops would add minutes to the slow lane for no path the loops make differ.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import time
from typing import TypeVar

import anyio
import pytest
import torch
from storeutil import Store, wait_until_stopped
from weightfleet import START_SECONDS, push_model, serve
from weightserver import model

import agang
from agang import PushReport, WeightPublisher, WeightSubscriber

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def store(module_store: str) -> str:
    return module_store  # one store for the module (``tests/gloo/conftest.py``)


T = TypeVar("T")


@pytest.fixture
def anyio_backend() -> str:
    # Cancellation at odd points is what these tests do: asyncio's wait_for is the
    # model of it, and the servers' own loops are asyncio whatever the test's is.
    return "asyncio"


async def _report_or_error(
    publisher: WeightPublisher, version: int, **kwargs: float
) -> PushReport | agang.GangError:
    try:
        return await publisher.push(version, **kwargs)
    except agang.GangError as error:
        return error


# -- membership ------------------------------------------------------------------------


async def test_a_second_publisher_fences_the_first(store: str) -> None:
    """A trainer started twice opens the same channel: on f239306 each kept its own
    servers (s1 got the first one's versions, s2 the second's), every report said
    delivered, and nothing failed. Now the second fences the first: once its ``open``
    returned, the first's pushes raise, naming it, and no server receives from it."""
    first = await WeightPublisher.open(model(0), store=store, channel="c", timeout=10)
    s1 = await WeightSubscriber.open(
        {k: torch.zeros_like(v) for k, v in model(0).items()}, store=store, channel="c", name="s1"
    )
    try:
        assert (await first.push(1)).delivered == ("s1",)
        assert await s1.receive(timeout=10) == 1
        second = await WeightPublisher.open(model(0), store=store, channel="c", timeout=10)
        try:
            with pytest.raises(agang.GangError, match=r"(?i)another publisher") as raised:
                await first.push(2)
            assert f"pid {os.getpid()}" in str(raised.value)
            with pytest.raises(agang.GangError, match=r"(?i)another publisher"):
                await first.push(3)
            s2 = await WeightSubscriber.open(
                {k: torch.zeros_like(v) for k, v in model(0).items()},
                store=store,
                channel="c",
                name="s2",
            )
            try:
                report = await second.push(101)
                assert "s2" in report.delivered, report
                assert await s2.receive(timeout=10) == 101
            finally:
                await s2.close()
            # s1 never got version 2 or 3; it either follows the new publisher or says
            # that another one opened the channel.
            got: int | str
            try:
                got = await s1.receive(timeout=3)
            except (agang.GangError, TimeoutError) as error:
                got = str(error)
            assert isinstance(got, str) or got >= 101, got
            assert not isinstance(got, str) or "another publisher" in got or not got, got
        finally:
            await second.close()
    finally:
        await s1.close()
        await first.close()


async def test_a_server_replaced_under_its_name_is_reported_delivered(store: str) -> None:
    """A server restarted under its name before the next push: on f239306 the new one
    received the version exactly and the report said ``delivered=[]`` ("replaced").
    Now the report counts the new one delivered, and says the old one was replaced."""
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(8)}, store=store, channel="c", timeout=10
    )
    old = await WeightSubscriber.open({"w": torch.zeros(8)}, store=store, channel="c", name="s")
    try:
        assert (await publisher.push(1)).delivered == ("s",)
        new = await WeightSubscriber.open({"w": torch.zeros(8)}, store=store, channel="c", name="s")
        try:
            report = await publisher.push(2)
            assert report.delivered == ("s",), report
            assert "replaced" in report.dropped.get("s", ""), report
            assert await new.receive(timeout=10) == 2
            assert await old.receive(timeout=10) == 1  # whole, before it was replaced
            with pytest.raises(agang.GangError, match="replaced"):
                await old.receive(timeout=10)
        finally:
            await new.close()
    finally:
        await old.close()
        await publisher.close()


async def test_a_push_right_after_a_close_says_it_closed(store: str) -> None:
    """A push within a beat of a server's close: on f239306 the report said "no answer
    (dead, stopped, or cut off from the store)" for a server that had closed."""
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(8)}, store=store, channel="c", timeout=10
    )
    try:
        for version in range(1, 4):
            server = await WeightSubscriber.open(
                {"w": torch.zeros(8)}, store=store, channel="c", name=f"s{version}"
            )
            assert f"s{version}" in (await publisher.push(10 * version)).delivered
            await server.close()
            report = await publisher.push(10 * version + 1)
            assert report.dropped == {f"s{version}": "it closed (left the channel)"}, report
    finally:
        await publisher.close()


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "in-place"])
async def test_tied_weights_are_delivered(store: str, in_place: bool) -> None:
    """One tensor under two names (a tied embedding's ``state_dict()``), at least a
    bucket in size: on f239306 every push dropped every server with a busy-tensor
    error, and an in-place server died. Its storage moves once, under its first name."""
    shared = torch.arange(1024.0)  # 4 KiB: above the 1 KiB buckets, so it moves alone
    weights = {"embed": shared, "small": torch.zeros(3), "head": shared}
    theirs = torch.zeros(1024)
    tensors = {"embed": theirs, "small": torch.zeros(3), "head": theirs}
    publisher = await WeightPublisher.open(
        weights, store=store, channel="c", timeout=10, bucket_bytes=1024
    )
    server = await WeightSubscriber.open(
        tensors, store=store, channel="c", name="s", in_place=in_place
    )
    try:
        for version in (1, 2, 3):
            shared.add_(1)
            weights["small"].fill_(version)
            report = await publisher.push(version)
            assert report.delivered == ("s",), report
            assert await server.receive(timeout=10) == version
            assert torch.equal(theirs, shared)
            assert torch.equal(tensors["small"], weights["small"])
    finally:
        await server.close()
        await publisher.close()


# -- clocks and pauses ------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-20.0, -2.0, 4.0], ids=["20s-behind", "2s-behind", "4s-ahead"])
async def test_a_server_whose_clock_is_off_is_admitted(
    store: str, started: list[subprocess.Popen[str]], skew: float
) -> None:
    """A server on a host whose wall clock is off: on f239306 one 2 s or 20 s behind
    was never admitted and in no report (the trainer read its beats' wall-clock times
    as old), and one 4 s ahead failed at once with "the publisher went away". Liveness
    is now judged on the reader's own monotonic clock."""
    weights = model(0)
    publisher = await WeightPublisher.open(weights, store=store, channel="w", timeout=10)
    try:
        server = serve(started, store, "skewed", "--clock-skew", str(skew))
        server.opened()
        report: PushReport | None = None
        for version in range(1, 6):
            report = await push_model(publisher, weights, version)
            if "skewed" in report.delivered:
                break
            await anyio.sleep(0.3)
        assert report is not None
        assert "skewed" in report.delivered, report
        server.received(version)
        await anyio.sleep(1.5)  # a server ahead gave up on the publisher at once here
        report = await push_model(publisher, weights, version + 1)
        assert report.delivered == ("skewed",), report
        server.received(version + 1)
    finally:
        await publisher.close()


async def test_a_server_paused_before_its_first_push_is_admitted_when_it_comes_back(
    store: str, started: list[subprocess.Popen[str]]
) -> None:
    """A server stopped (SIGSTOP) for 16 s after it opened, before any push: on
    f239306 the trainer forgot it without a drop, and after SIGCONT it waited for ever
    ("registered, waiting to be admitted at the next push"). Now it is dropped and
    told while it sleeps, or admitted; once back, it is admitted and receives."""
    weights = model(0)
    publisher = await WeightPublisher.open(weights, store=store, channel="w", timeout=3)
    try:
        server = serve(started, store, "sleeper")
        pid = server.opened()
        os.kill(pid, signal.SIGSTOP)
        try:
            await anyio.sleep(16.0)
            report = await push_model(publisher, weights, 1)
            assert "sleeper" not in report.delivered, report
        finally:
            os.kill(pid, signal.SIGCONT)
        delivered = False
        give_up_at = time.monotonic() + 20.0
        version = 1
        while not delivered and time.monotonic() < give_up_at:
            version += 1
            delivered = "sleeper" in (await push_model(publisher, weights, version)).delivered
            await anyio.sleep(0.3)
        assert delivered, "the paused server was never admitted after SIGCONT"
        server.received(version)
    finally:
        await publisher.close()


# -- the store ---------------------------------------------------------------------------


async def test_a_stalled_store_blames_the_store_and_bounds_the_push(
    started: list[subprocess.Popen[str]],
) -> None:
    """The store stopped (SIGSTOP) for 10 s, and a server killed meanwhile: on f239306
    the push (2 s deadline) that found the server dead needed the store to ask where it
    stood, and raised only after 8 s; and the live server, whose round failed with it,
    then blamed the live publisher ("it has not beaten on the store ... for 10.1 s
    (dead or stopped)") and gave up. Now the push returns within its deadline and the
    recovery bound, dropping the dead server, and the live one goes on receiving."""
    process = Store(started, "--port", "0", "--quiet")
    address = process.out.next(START_SECONDS).split()[-1]
    weights = model(0)
    publisher = await WeightPublisher.open(weights, store=address, channel="w", timeout=10)
    live = await WeightSubscriber.open(
        {k: torch.zeros_like(v) for k, v in model(0).items()},
        store=address,
        channel="w",
        name="live",
        timeout=30,
    )
    doomed = serve(started, address, "doomed")
    doomed.opened()
    try:
        report = await push_model(publisher, weights, 1)
        assert set(report.delivered) == {"live", "doomed"}, report
        assert await live.receive(timeout=10) == 1
        process.process.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            doomed.kill()
            began = time.monotonic()
            outcome = await _report_or_error(publisher, 2, timeout=2.0)
            if isinstance(outcome, agang.GangError):  # the store's silence, named
                assert address in str(outcome), outcome
            else:
                assert "doomed" in outcome.dropped, outcome
            assert time.monotonic() - began < 2.0 + 2.0 + 3.0
            await anyio.sleep(max(0.0, 10.0 - (time.monotonic() - stopped_at)))
        finally:
            process.process.send_signal(signal.SIGCONT)
        delivered = False
        for version in range(3, 10):
            delivered = "live" in (await publisher.push(version)).delivered
            if delivered:
                break
            await anyio.sleep(0.5)
        assert delivered
        assert await live.receive(timeout=10) >= 3
    finally:
        await live.close()
        await publisher.close()


async def test_a_lost_store_fails_naming_it_and_the_channel_recovers(
    started: list[subprocess.Popen[str]],
) -> None:
    """The store killed, then started again on its port: on f239306 every push and
    ``close()`` raised a raw ``DistNetworkError: Broken pipe``, and the publisher never
    recovered. Now, while the store is gone, a push delivers over the epoch's own
    connections (it needs no store op) or raises ``GangError`` naming the store; once a
    store is back the trainer opens its session there again: its server goes on, and
    a new server subscribes and receives."""
    first = Store(started, "--port", "0", "--quiet")
    address = first.out.next(START_SECONDS).split()[-1]
    port = address.rsplit(":", 1)[1]
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(8)}, store=address, channel="c", timeout=5
    )
    server = await WeightSubscriber.open(
        {"w": torch.zeros(8)}, store=address, channel="c", name="s", timeout=30
    )
    late: WeightSubscriber | None = None
    try:
        assert (await publisher.push(1)).delivered == ("s",)
        first.kill()
        for version in range(2, 5):
            outcome = await _report_or_error(publisher, version, timeout=2.0)
            if isinstance(outcome, agang.GangError):
                assert address in str(outcome), outcome
            else:
                assert outcome.delivered == ("s",), outcome
        Store(started, "--port", port, "--quiet").out.next(START_SECONDS)
        late = await WeightSubscriber.open(
            {"w": torch.zeros(8)}, store=address, channel="c", name="late", timeout=30
        )
        delivered: set[str] = set()
        give_up_at = time.monotonic() + 30.0
        version = 10
        while delivered != {"s", "late"} and time.monotonic() < give_up_at:
            version += 1
            with anyio.move_on_after(10), contextlib.suppress(agang.GangError):
                delivered = set((await publisher.push(version, timeout=2.0)).delivered)
            await anyio.sleep(0.3)
        assert delivered == {"s", "late"}, (
            f"the channel did not recover once a store was back: s is "
            f"{server._service.status}; its store: {server._upstream.trouble}; its error: "
            f"{server._service.error}"
        )
        assert await server.receive(timeout=10) == version
        assert await late.receive(timeout=10) == version
    finally:
        with anyio.move_on_after(15):
            if late is not None:
                await late.close()
            await server.close()
        with anyio.move_on_after(15):
            await publisher.close()


async def test_an_unreachable_store_is_named_for_the_weights() -> None:
    """On f239306 the weights' store errors said "An elastic gang needs a store ..."."""
    with pytest.raises(agang.GangInitError) as raised:
        await WeightSubscriber.open(
            {"w": torch.zeros(2)}, store="127.0.0.1:1", channel="c", timeout=1
        )
    assert "elastic" not in str(raised.value)
    assert "weights" in str(raised.value)
    assert "127.0.0.1:1" in str(raised.value)


async def test_no_deadline_is_math_inf(store: str) -> None:
    """``timeout=math.inf`` is agang's "no deadline": on f239306 it raised
    ``OverflowError`` at ``open``."""
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(2)}, store=store, channel="c", timeout=math.inf
    )
    server = await WeightSubscriber.open(
        {"w": torch.zeros(2)}, store=store, channel="c", name="s", timeout=math.inf
    )
    try:
        assert (await publisher.push(1)).delivered == ("s",)
        assert (await publisher.push(2, timeout=math.inf)).delivered == ("s",)
        assert await server.receive(timeout=math.inf) == 2
    finally:
        await server.close()
        await publisher.close()


async def test_a_server_reported_dead_is_dropped_at_once_with_the_watchers_why(
    store: str, started: list[subprocess.Popen[str]]
) -> None:
    """A server stopped (SIGSTOP) while a push with a 30 s deadline waits on it; a
    watcher reports it dead by its host and pid (``agang.report_death``): the push ends
    at once, dropping it with the watcher's why, and delivers to the other."""
    weights = model(0)
    publisher = await WeightPublisher.open(weights, store=store, channel="w", timeout=30)
    try:
        stopped = serve(started, store, "stopped")
        live = serve(started, store, "live")
        pid = stopped.opened()
        live.opened()
        report = await push_model(publisher, weights, 1)
        assert set(report.delivered) == {"stopped", "live"}, report
        live.received(1)
        os.kill(pid, signal.SIGSTOP)
        wait_until_stopped(pid)

        async def watcher() -> None:
            await anyio.sleep(0.5)
            who = f"{socket.gethostname()}, pid {pid}"
            await agang.report_death(store, who, "stopped by the test")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watcher)
            report = await push_model(publisher, weights, 2)
        assert report.delivered == ("live",), report
        assert report.dropped["stopped"].endswith(": stopped by the test"), report
        assert report.seconds < 30.0 / 10, report
        live.received(2)
    finally:
        await publisher.close()


# -- a stranger on the store ----------------------------------------------------------------

SECRET = "a secret of 16 bytes or more"


def _forge_leave(publisher: WeightPublisher, uid: str) -> None:
    """What a stranger who reaches the store can write: a 'leave' of a live server."""
    channel = publisher._channel
    channel.store.queue_push(f"{channel.prefix}/news", f"leave {uid}")
    channel.store.add(f"{channel.prefix}/joined", 1)


async def test_without_a_secret_a_forged_leave_strands_a_live_server(store: str) -> None:
    """The store is open (``docs/guides/trust.md``): without a secret, a stranger's
    'leave' is taken as the server's own. What a secret is for (the next test)."""
    publisher = await WeightPublisher.open({"w": torch.zeros(4)}, store=store, channel="c")
    server = await WeightSubscriber.open({"w": torch.zeros(4)}, store=store, channel="c", name="s")
    try:
        assert (await publisher.push(1)).delivered == ("s",)
        _forge_leave(publisher, server._me.uid)
        await anyio.sleep(0.5)  # the publisher reads the news at its next beat
        report = await publisher.push(2)
        assert report.dropped == {"s": "it closed (left the channel)"}, report
    finally:
        await server.close()
        await publisher.close()


async def test_with_a_secret_a_stranger_can_neither_publish_nor_strand_a_server(
    store: str,
) -> None:
    """On f239306 a stranger with the store's address read the plan and served its own
    weights to every new server, and a forged 'leave' stranded a live server while the
    report said it closed. With a channel secret: the forged leave and drop are ignored,
    a stranger's publisher (no secret) fences nobody and reaches no server, and the
    holder key it overwrote is taken back, so a new server still finds the channel."""
    weights = {"w": torch.zeros(4)}
    publisher = await WeightPublisher.open(weights, store=store, channel="c", secret=SECRET)
    server = await WeightSubscriber.open(
        {"w": torch.zeros(4)}, store=store, channel="c", name="s", secret=SECRET
    )
    stranger: WeightPublisher | None = None
    late: WeightSubscriber | None = None
    try:
        weights["w"].fill_(1)
        assert (await publisher.push(1)).delivered == ("s",)
        _forge_leave(publisher, server._me.uid)
        channel = publisher._channel
        channel.store.set(f"{channel.prefix}/dropped/{server._me.uid}", "replaced: by me")
        await anyio.sleep(0.5)  # read (and ignored) at the next beat of each side
        weights["w"].fill_(2)
        report = await publisher.push(2)
        assert report.delivered == ("s",), report
        assert report.dropped == {}, report
        assert await server.receive(timeout=10) == 2
        # A stranger's publisher on the channel, without the secret.
        stranger = await WeightPublisher.open(
            {"w": torch.full((4,), 666.0)}, store=store, channel="c", timeout=5
        )
        assert (await stranger.push(666)).delivered == ()
        weights["w"].fill_(3)
        assert (await publisher.push(3)).delivered == ("s",)  # not fenced
        assert await server.receive(timeout=10) == 3
        assert torch.equal(server._tensors["w"], torch.full((4,), 3.0))
        await anyio.sleep(0.5)  # a beat or two: the publisher takes its holder key back
        late = await WeightSubscriber.open(
            {"w": torch.zeros(4)}, store=store, channel="c", name="late", secret=SECRET
        )
        weights["w"].fill_(4)
        assert set((await publisher.push(4)).delivered) == {"s", "late"}
        assert await late.receive(timeout=10) == 4
    finally:
        for side in (late, server, stranger, publisher):
            if side is not None:
                await side.close()


async def test_a_subscriber_without_the_channels_secret_is_told_so(store: str) -> None:
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(4)}, store=store, channel="c", secret=SECRET
    )
    try:
        with pytest.raises(agang.GangInitError, match="sealed with a secret"):
            await WeightSubscriber.open({"w": torch.zeros(4)}, store=store, channel="c")
        with pytest.raises(agang.GangInitError, match="another secret"):
            await WeightSubscriber.open(
                {"w": torch.zeros(4)}, store=store, channel="c", timeout=1,
                secret="another secret, also long enough",
            )  # fmt: skip
        with pytest.raises(ValueError, match="`secret` must be at least 16 bytes"):
            await WeightSubscriber.open(
                {"w": torch.zeros(4)}, store=store, channel="c", secret="short"
            )
    finally:
        await publisher.close()
