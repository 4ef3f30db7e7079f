from __future__ import annotations

import pytest
import torch

import agang
from agang.testing import FakeWorld

pytestmark = pytest.mark.anyio


async def test_fake_world_all_reduce() -> None:
    world = FakeWorld(3)

    async def step(gang: agang.Gang) -> list[float]:
        t = torch.full((2,), float(gang.rank + 1))
        return (await gang.all_reduce(t)).tolist()

    assert await world.run(step) == [[6.0, 6.0]] * 3
