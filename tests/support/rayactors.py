"""Ray actors of the Ray tests and bench (``tests/gloo/test_ray.py``, ``bench/bench_ray.py``).

They live in an importable module (the tests put ``tests/support`` on the workers'
``PYTHONPATH``), so Ray's workers import them by name. Every method is async: agang's
calls run on the actor's event loop. What a member saw is returned as plain data
(times are ``time.time()``: the tests' processes share one machine's clock).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

import agang.ray as ar


class GangMember(ar.Member):
    """A member of a test gang."""

    def __init__(self) -> None:
        self.gang: Any = None
        self.subscriber: Any = None
        self.tensors: dict[str, torch.Tensor] = {}

    async def pid(self) -> int:
        return os.getpid()

    async def join(self, spec: ar.GangSpec) -> dict[str, Any]:
        self.gang = await ar.join(spec)
        return {
            "rank": self.gang.rank,
            "size": self.gang.size,
            "pid": os.getpid(),
            "default_group": dist.is_initialized(),
        }

    async def all_reduce(self, value: float) -> dict[str, Any]:
        """One all-reduce of ``value``; its result, or its error and when it came."""
        tensor = torch.full((4,), float(value))
        try:
            await self.gang.all_reduce(tensor)
        except Exception as error:
            return {"error": type(error).__name__, "message": str(error), "at": time.time()}
        return {"result": tensor.tolist(), "at": time.time()}

    async def reform(self) -> dict[str, Any]:
        started = time.time()
        self.gang = await self.gang.reform()
        return {
            "rank": self.gang.rank,
            "size": self.gang.size,
            "epoch": self.gang.epoch,
            "seconds": time.time() - started,
        }

    async def close(self) -> None:
        if self.gang is not None:
            await self.gang.close()

    async def subscribe(self, store: str, channel: str) -> str:
        self.tensors = {"w": torch.zeros(8)}
        self.subscriber = await ar.subscribe(self.tensors, store=store, channel=channel, timeout=30)
        return str(self.subscriber.name)

    async def receive(self) -> dict[str, Any]:
        version = await self.subscriber.receive()
        return {"version": version, "w": self.tensors["w"].tolist()}

    async def waiting(self) -> int:
        """How many joiners the gang's next reform would admit."""
        return int(self.gang.waiting_to_join())
