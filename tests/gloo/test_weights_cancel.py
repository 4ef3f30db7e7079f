"""What asyncio programs do to a weights channel (issue 32): a push or a ``receive``
cancelled at odd points, as ``asyncio.wait_for``, ``anyio.fail_after`` or a task group's
cancel does it, on every loop (asyncio, uvloop, trio).

Each test here failed on f239306; the failure each one caught is in its docstring. The
trainer and the servers run in this process, each server's rounds on a thread and loop
of its own (``agang._weights.service``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import pytest
import torch
from storeutil import wait_until_stopped
from weightfleet import push_model, serve
from weightserver import model

from agang import WeightPublisher, WeightSubscriber
from agang._weights.publisher import CANCEL_GRACE

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
def store(module_store: str) -> str:
    return module_store  # one store for the module (``tests/gloo/conftest.py``)


T = TypeVar("T")

BIG = 4 << 20  # floats of 'big': 16 MiB, a round that lasts past the cancel


async def _cancelled_after(seconds: float, fn: Callable[[], Awaitable[T]]) -> T | None:
    """``fn()``'s result, or None where it was cancelled ``seconds`` after it began."""
    with anyio.move_on_after(seconds):
        return await fn()
    return None


def _uniform(tensor: torch.Tensor) -> float | None:
    """The one value ``tensor`` holds everywhere, or None where it holds several."""
    values = torch.unique(tensor).tolist()
    return float(values[0]) if len(values) == 1 else None


@pytest.mark.parametrize("in_place", [False, True], ids=["staging", "in-place"])
async def test_a_cancelled_push_never_tears_a_version(store: str, in_place: bool) -> None:
    """A push cancelled mid-round, then the trainer's next step writes its tensors: on
    f239306 the cancelled round went on reading them, and both servers' ``receive``
    returned the cancelled version holding a mix of it and the next (2 of 2 runs).
    Now a server either never sees the cancelled version or holds it whole, and the
    next push delivers normally. The cancel lands at several points of the round."""
    size = 4 << 20  # 16 MiB: a round lasts about ten ms here
    weights = {"w": torch.zeros(size)}
    publisher = await WeightPublisher.open(weights, store=store, channel="c", timeout=20)
    server = await WeightSubscriber.open(
        {"w": torch.zeros(size)}, store=store, channel="c", name="s", in_place=in_place
    )
    try:
        version = 1
        weights["w"].fill_(version)
        assert (await publisher.push(version)).delivered == ("s",)
        assert await server.receive(timeout=20) == version
        for delay in (0.002, 0.01, 0.03):
            version += 1
            weights["w"].fill_(version)
            report = await _cancelled_after(delay, lambda v=version: publisher.push(v))
            weights["w"].fill_(version + 0.5)  # the trainer's next step
            if report is None:  # cancelled: the server holds it whole, or never had it
                with anyio.move_on_after(1.0):
                    got = await server.receive()
                    held = _uniform(server._tensors["w"])
                    assert (got, held) == (version, version), (delay, got, held)
            version += 1
            weights["w"].fill_(version)
            report = await publisher.push(version)
            assert report.delivered == ("s",), (delay, report)
            assert await server.receive(timeout=20) == version
            assert _uniform(server._tensors["w"]) == version
    finally:
        await server.close()
        await publisher.close()


async def test_a_cancelled_receive_keeps_the_version_whole(store: str) -> None:
    """``receive`` cancelled while it copies a version into the server's tensors (a
    model over 1 MiB copies on a thread): on f239306 the copy went on after the cancel,
    so the tensors held two versions, and the version was lost (the next ``receive``
    timed out with "no version newer than 1"). Now the cancelled receive leaves the
    tensors whole, and the next ``receive`` returns the version at once."""
    size = 4 << 20  # 16 MiB
    publisher = await WeightPublisher.open(
        {"w": torch.ones(size)}, store=store, channel="c", timeout=20
    )
    tensors = {"w": torch.zeros(size)}
    server = await WeightSubscriber.open(tensors, store=store, channel="c", name="s")
    try:
        assert (await publisher.push(1)).delivered == ("s",)
        with anyio.CancelScope() as scope:
            scope.cancel()  # at receive's first wait: the copy's thread has started
            await server.receive(timeout=20)
        assert _uniform(tensors["w"]) in (0.0, 1.0)
        with anyio.fail_after(2):
            assert await server.receive(timeout=20) == 1
        assert _uniform(tensors["w"]) == 1.0
        assert server.version == 1
    finally:
        await server.close()
        await publisher.close()


async def test_a_push_cancelled_while_it_admits_does_not_stall_the_channel(store: str) -> None:
    """A push cancelled while it admitted a new server: on f239306 every later push
    reported ``delivered=[] dropped={}`` at once (12 of 12) and the server waited for
    its go until someone new joined. Now a later push admits it and delivers."""
    publisher = await WeightPublisher.open(
        {"w": torch.zeros(16)}, store=store, channel="c", timeout=10
    )
    servers: list[WeightSubscriber] = []
    try:
        for index, delay in enumerate((0.001, 0.005, 0.02, 0.05)):
            servers.append(
                await WeightSubscriber.open(
                    {"w": torch.zeros(16)}, store=store, channel="c", name=f"s{index}"
                )
            )
            base = 10 * (index + 1)
            await _cancelled_after(delay, lambda v=base: publisher.push(v))
            delivered: set[str] = set()
            for version in range(base + 1, base + 4):
                report = await publisher.push(version)
                delivered |= set(report.delivered)
                if len(delivered) == len(servers):
                    break
            assert delivered == {s.name for s in servers}, (delay, report)
    finally:
        for server in servers:
            await server.close()
        await publisher.close()


async def test_a_push_cancelled_while_a_server_is_stopped_aborts_in_time_and_tears_nothing(
    started: list[subprocess.Popen[str]], store: str
) -> None:
    """A push cancelled while one server is stopped (SIGSTOP) mid-round, so that the
    round cannot end: the cancel comes back within the grace and the gang's close, and
    the trainer's next step then writes its tensors. On f239306 the cancelled round went
    on sending to the stopped server, which read bytes written after the cancel once it
    woke: a torn version it took as whole. Now the round is aborted before the cancel
    goes on: woken, the server holds no torn version, and is admitted again."""
    weights = model(0, big=BIG)
    publisher = await WeightPublisher.open(weights, store=store, channel="w", timeout=20)
    try:
        server = serve(started, store, "sleeper", "--big", str(BIG))
        pid = server.opened()
        assert (await push_model(publisher, weights, 1, big=BIG)).delivered == ("sleeper",)
        server.received(1)
        os.kill(pid, signal.SIGSTOP)
        wait_until_stopped(pid)
        began = time.monotonic()
        assert (
            await _cancelled_after(0.3, lambda: push_model(publisher, weights, 2, big=BIG)) is None
        )
        took = time.monotonic() - began
        for name, value in model(3, big=BIG).items():  # the trainer's next step
            weights[name].copy_(value)
        assert took < 0.3 + CANCEL_GRACE + 6.0, took  # the grace, then the gang's close
        os.kill(pid, signal.SIGCONT)
        delivered = False
        give_up_at = time.monotonic() + 30.0
        version = 3
        while not delivered and time.monotonic() < give_up_at:
            version += 1
            delivered = (
                "sleeper" in (await push_model(publisher, weights, version, big=BIG)).delivered
            )
            await anyio.sleep(0.3)
        assert delivered
        server.received(version)  # every version it said it took was exact, till this
    finally:
        await publisher.close()
