"""The mixin that lets agang watch a Ray actor's death: ``agang.ray.Member``."""

from __future__ import annotations

import os

import anyio


class Member:
    """Mix into an async Ray actor's class to have its death told to its gangs and
    channels within milliseconds (``agang.ray``, rule 3).

    It adds two methods: ``agang_parked``, that the job's watcher calls once per actor
    incarnation and that never returns (Ray fails that pending call as soon as it
    knows the actor is gone, and the watcher files a death notice then), and
    ``agang_pid``. The actor's own methods are untouched; it costs one idle coroutine.

    Example:
        <!-- not-run: needs a Ray cluster -->
        ```python
        @ray.remote
        class Trainer(agang.ray.Member):
            async def train(self, spec):
                gang = await agang.ray.join(spec)
        ```
    """

    async def agang_parked(self) -> None:
        """Waits for ever; the watcher's pending call (the class's docstring)."""
        await anyio.sleep_forever()

    async def agang_pid(self) -> int:
        """This incarnation's pid: the watcher asks it where Ray says the actor is
        unavailable, which may be a restart or a passing fault."""
        return os.getpid()
