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
