"""``WeightSubscriber.open`` cancelled leaves nothing behind.

``open`` waits on threads of its own (for the channel's plan, then for the publisher to
see its registration): a cancelled ``open`` must end them, and close a subscriber it
had already made. Before, its thread polled the store until ``open``'s own deadline,
and the interpreter's exit then waited for it (5 s).
"""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

import agang
from agang import PushReport

pytestmark = [pytest.mark.gloo, pytest.mark.anyio, pytest.mark.timeout(60)]


def _weights_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "weights" in t.name]


async def test_a_cancelled_open_ends_its_threads(store: str) -> None:
    before = _weights_threads()
    with anyio.move_on_after(0.5) as scope:  # no publisher on "nobody": open waits
        await agang.WeightSubscriber.open(
            {"w": torch.zeros(4)}, store=store, channel="nobody", timeout=30.0
        )
    assert scope.cancelled_caught
    for _ in range(100):  # 5 s; it polls every 50 ms, and open's deadline is 30 s
        if _weights_threads() == before:
            break
        await anyio.sleep(0.05)
    assert _weights_threads() == before


async def test_a_close_right_after_receive_leaves_the_push_delivered(store: str) -> None:
    """A server that closes as soon as ``receive`` returned: its version came whole, so
    the push counts it delivered, not dropped (the close used to close the group under
    the version's confirmation, and the round failed); and the next push leaves it out
    at once, saying so (it used to wait 2 s for it to come). Five servers in turn."""
    tensors = {"w": torch.arange(4.0)}
    publisher = await agang.WeightPublisher.open(tensors, store=store, channel="c", timeout=20)
    try:
        for version in range(1, 6):
            subscriber = await agang.WeightSubscriber.open(
                {"w": torch.zeros(4)}, store=store, channel="c", name=f"s{version}"
            )
            reports: list[PushReport] = []

            async def push(v: int = version, into: list[PushReport] = reports) -> None:
                into.append(await publisher.push(v))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(push)
                assert await subscriber.receive(timeout=20) == version
                await subscriber.close()
            report = reports[0]
            assert report.delivered == (f"s{version}",), report
            # The last one closed: left out at once, not waited for (2 s) and dropped.
            left = {} if version == 1 else {f"s{version - 1}": "it closed (left the channel)"}
            assert report.dropped == left, report
    finally:
        await publisher.close()
