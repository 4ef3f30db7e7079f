"""A sharded server's faults over real processes and Gloo: a 2-rank sharded trainer and a
2-rank sharded server, each rank a process of ``tests/support/shardedrank.py`` that the
test kills by pid, and a whole server here, on one channel. A server rank killed
mid-push, the whole server killed and started again under its name over a new gang,
its rank 0 killed: each outcome exact, with blame, and in bounded time. The same
protocol's cases in one process: ``tests/world/test_weights_sharded_servers.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from shardedrank import model
from storeutil import SUPPORT, Spawned, wait_until_stopped
from weightfleet import START_SECONDS, Server

from agang import WeightSubscriber

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]

#: What a rank's loss may take to show (the push that drops its server returns, the
#: other ranks' ``receive`` raises) or a ``close`` to return, counted from the kill: a
#: killed rank's connections close at once, and its server's rank 0 reports it dead, which
#: ends the round at once (publisher rule 8). 0.4-0.6 s on the loaded 2-core machine
#: (2026-11-30), a close 0.01 s; a round the notice did not end waited for the server's
#: own give-up, 10 s (``agang._weights.service``'s ``_give_up``).
BOUND = 8.0
#: A push's report, a receive: far beyond the push's own deadline (20 s).
PATIENCE = 60.0


@pytest.fixture
def store(module_store: str) -> str:
    return module_store


class Rank(Server):
    """A rank of ``shardedrank.py`` (its events as ``Server``'s), started at once."""

    def __init__(self, started: list[subprocess.Popen[str]], *arguments: str) -> None:
        Spawned.__init__(self, started, [str(SUPPORT / "shardedrank.py"), *arguments], stdin=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def took(self, version: int) -> None:
        """It received ``version``, exact (an older one may come first)."""
        for _ in range(100):
            event = self.event("received", "failed", timeout=PATIENCE)
            if event["event"] == "received" and event["version"] < version:
                continue
            assert event == {"event": "received", "version": version, "exact": True}, event
            return
        raise AssertionError(f"version {version} never came")


class Ranks:
    """A gang's ranks, each a process, on a rendezvous store hosted here (port 0: the
    kernel's pick, no race); the store lives as long as this object."""

    def __init__(
        self,
        started: list[subprocess.Popen[str]],
        role: str,
        store: str,
        channel: str,
        *extra: str,
        size: int = 2,
    ) -> None:
        self.rendezvous = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=START_SECONDS),
        )  # fmt: skip
        port = str(self.rendezvous.port)
        self.ranks = [
            Rank(started, role, str(rank), str(size), port, store, channel, *extra)
            for rank in range(size)
        ]

    def __getitem__(self, rank: int) -> Rank:
        return self.ranks[rank]

    def opened(self) -> None:
        for rank in self.ranks:
            event = rank.event("opened", timeout=START_SECONDS)
            # The ranks import this worktree's agang, as the test does.
            assert event["agang"].startswith(str(SUPPORT.parents[1])), event


class Fleet:
    """The trainer's ranks, a sharded server's ranks ("sharded"), and a whole server
    ("whole", a subscriber in this process), on ``channel``."""

    def __init__(self, started: list[subprocess.Popen[str]], store: str, channel: str) -> None:
        self.started = started
        self.store = store
        self.channel = channel
        self.trainer = Ranks(started, "trainer", store, channel)
        self.sharded = self.server()
        self.whole: WeightSubscriber | None = None
        self.version = 0

    def server(self) -> Ranks:
        """A sharded server's ranks, named "sharded", over a new gang."""
        return Ranks(self.started, "server", self.store, self.channel, "--name", "sharded")

    async def open(self) -> None:
        self.trainer.opened()
        zeros = {name: torch.zeros_like(value) for name, value in model(0).items()}
        self.whole = await WeightSubscriber.open(
            zeros, store=self.store, channel=self.channel, name="whole", timeout=20
        )
        self.sharded.opened()

    def start_push(self) -> int:
        self.version += 1
        for rank in self.trainer.ranks:
            rank.send(str(self.version))
        return self.version

    def pushed(self) -> dict[str, Any]:
        """The report of the push under way, the same on every trainer rank."""
        reports = [rank.event("pushed", timeout=PATIENCE) for rank in self.trainer.ranks]
        assert all(report == reports[0] for report in reports), reports
        assert reports[0]["version"] == self.version, reports
        return reports[0]

    async def push(self) -> dict[str, Any]:
        self.start_push()
        return self.pushed()

    async def whole_took(self, version: int) -> None:
        assert self.whole is not None
        assert await self.whole.receive(timeout=PATIENCE) == version
        for name, value in model(version).items():
            assert torch.equal(self.whole._tensors[name], value), (version, name)

    async def until_both(self, sharded: Ranks) -> int:
        """Pushes until a push reaches "sharded" too (it is admitted at a round's
        boundary), each reaching "whole"; every rank of ``sharded`` then holds it."""
        for _ in range(20):
            report = await self.push()
            assert "whole" in report["delivered"], report
            await self.whole_took(self.version)
            if report["delivered"] == ["sharded", "whole"]:
                for rank in sharded.ranks:
                    rank.took(self.version)
                return self.version
        raise AssertionError(f"'sharded' was never admitted; the last report: {report}")

    async def close(self) -> None:
        if self.whole is not None:
            await self.whole.close()
        for rank in self.trainer.ranks:  # the end of stdin: the channel closes
            if rank.process.stdin is not None and rank.process.poll() is None:
                rank.process.stdin.close()


@pytest.fixture
async def fleet(started: list[subprocess.Popen[str]], store: str) -> AsyncIterator[Fleet]:
    made = Fleet(started, store, f"sharded-faults-{os.getpid()}-{time.monotonic_ns()}")
    try:
        await made.open()
        yield made
    finally:
        await made.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _failed(rank: Rank, since: float) -> dict[str, Any]:
    """The ``failed`` event of ``rank``, which must come within ``BOUND`` of ``since``."""
    event = rank.event("received", "failed", timeout=max(0.0, since + BOUND - time.monotonic()))
    assert event["event"] == "failed", event
    assert time.monotonic() - since < BOUND, event
    return event


def _closed(rank: Rank) -> None:
    """Its ``close`` after the failure returned, within ``BOUND``."""
    event = rank.event("closed", timeout=BOUND)
    assert event["seconds"] < BOUND, event


async def test_a_server_rank_killed_mid_push_drops_its_server_alone_naming_the_rank(
    fleet: Fleet,
) -> None:
    """Rank 1 of the sharded server is stopped, a push begins (its round waits for rank
    1's acknowledgement), and rank 1 is SIGKILLed: the push drops "sharded" naming
    server rank 1 and delivers to "whole"; rank 0's ``receive`` raises a ``GangError``
    naming rank 1, and its ``close`` returns, both in bounded time; the next push
    delivers to "whole" alone, exact."""
    held = await fleet.until_both(fleet.sharded)
    victim = fleet.sharded[1]
    os.kill(victim.pid, signal.SIGSTOP)
    wait_until_stopped(victim.pid)
    version = fleet.start_push()
    await anyio.sleep(0.5)  # the round is under way: rank 0 waits on the stopped rank
    killed_at = time.monotonic()
    victim.kill()
    report = fleet.pushed()
    assert time.monotonic() - killed_at < BOUND, report
    assert report["delivered"] == ["whole"], report
    assert "server rank 1" in report["dropped"].get("sharded", ""), report
    await fleet.whole_took(version)
    failed = _failed(fleet.sharded[0], killed_at)
    assert failed["error"] == "GangError", failed
    assert "server rank 1" in failed["message"], failed
    _closed(fleet.sharded[0])
    after = await fleet.push()
    assert after["delivered"] == ["whole"], after
    await fleet.whole_took(after["version"])
    assert held < version < after["version"]


async def test_a_sharded_server_killed_and_started_again_is_admitted_and_exact_on_every_rank(
    fleet: Fleet,
) -> None:
    """Both ranks of the sharded server are SIGKILLed: the next push drops it and
    delivers to "whole"; new processes open again, named "sharded", over a new gang,
    are admitted at a round's boundary, and each rank holds its exact slices of every
    version pushed after."""
    await fleet.until_both(fleet.sharded)
    for rank in fleet.sharded.ranks:
        rank.kill()
    report = await fleet.push()
    assert report["seconds"] < BOUND, report
    assert report["delivered"] == ["whole"], report
    assert "sharded" in report["dropped"], report
    await fleet.whole_took(report["version"])
    again = fleet.server()
    again.opened()
    await fleet.until_both(again)
    for _ in range(2):
        report = await fleet.push()
        assert report["delivered"] == ["sharded", "whole"], report
        assert not report["dropped"], report
        await fleet.whole_took(report["version"])
        for rank in again.ranks:
            rank.took(report["version"])


async def test_rank_0_of_a_sharded_server_killed_fails_the_others_receive_with_blame(
    fleet: Fleet,
) -> None:
    """Rank 0 of the sharded server (the channel's member, which relays) is SIGKILLed:
    rank 1's ``receive`` raises a ``GangError`` naming its lost rank 0, in bounded
    time, and its ``close`` returns; the next push drops "sharded" and delivers to
    "whole", exact, and so does the one after."""
    await fleet.until_both(fleet.sharded)
    killed_at = time.monotonic()
    fleet.sharded[0].kill()
    failed = _failed(fleet.sharded[1], killed_at)
    assert failed["error"] == "GangError", failed
    assert "rank 0" in failed["message"], failed
    _closed(fleet.sharded[1])
    report = await fleet.push()
    assert report["seconds"] < BOUND, report
    assert report["delivered"] == ["whole"], report
    assert "sharded" in report["dropped"], report
    await fleet.whole_took(report["version"])
    after = await fleet.push()
    assert after["delivered"] == ["whole"], after
    await fleet.whole_took(after["version"])
