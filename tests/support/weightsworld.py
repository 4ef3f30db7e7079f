"""The weights channel in one process, for ``tests/world/test_weights*.py``: an
in-process store and epoch gangs over FakeWorld (``agang.testing._world.epochs``), and
the production publisher and subscribers on them."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import torch
import torch.distributed as dist

from agang._weights.plan import Plan
from agang._weights.publisher import WeightPublisher
from agang._weights.site import Site
from agang._weights.subscriber import WeightSubscriber
from agang.testing._world.epochs import FakeEpochs


class Channel:
    """One channel's site (an in-process store, FakeWorld epochs) and its sides."""

    def __init__(self, latency: float = 0.0) -> None:
        # A TCPStore, as in production. With two threads blocked in a HashStore's
        # queue_pop, a push to one's queue wakes neither until its timeout (torch
        # 2.13): a stop letter went unread and a close took 2 s; and its instant
        # letters hid a race of death notices that a TCPStore showed.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.epochs = FakeEpochs(latency)
        self.site = Site("in-process store", lambda _: self.store, self.epochs)
        self.opened: list[Any] = []
        self.together: list[Any] = []  # the ranks of gangs' sides, closed at once

    async def publisher(
        self, tensors: dict[str, torch.Tensor], deadline: float | None = 5.0, **plan: Any
    ) -> WeightPublisher:
        """A publisher whose pushes have ``deadline`` seconds each."""
        opened = await WeightPublisher._open(
            tensors, Plan.of(tensors, **plan), "c", deadline, None, self.site
        )
        self.opened.append(opened)
        return opened

    async def subscriber(
        self, tensors: dict[str, torch.Tensor], name: str, *, in_place: bool = False
    ) -> WeightSubscriber:
        opened = await WeightSubscriber._open(tensors, "c", name, 10.0, in_place, None, self.site)
        self.opened.append(opened)
        return opened

    def kill(self, subscriber: WeightSubscriber) -> None:
        """``subscriber``'s process dies: no beat, no answer, its connections closed."""
        subscriber._upstream.stop()
        subscriber._responder.stop()
        self.epochs.kill(subscriber._me.uid, "killed")
        subscriber._service._stopping.set()

    async def close(self) -> None:
        """Closes every side: the ranks of a gang's side (``together``) at once, as their
        close is collective, then the others, the last opened first."""
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for side in self.together:
                    group.start_soon(side.close)
            for side in reversed(self.opened):
                await side.close()


def agang_threads() -> set[threading.Thread]:
    """agang's threads of one object or call ("agang: ..."), not the process's own timer."""
    return {t for t in threading.enumerate() if t.name.startswith("agang:") and t.is_alive()}
