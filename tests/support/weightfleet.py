"""The weights tests' fleet (``tests/gloo/test_weights*.py``): weight servers as processes
of ``tests/support/weightserver.py`` whose stdout is read as JSON events, and the test's
own publisher pushing ``weightserver.model(version)``.

The fixtures that start the processes (``started``, ``store``) are in
``tests/gloo/conftest.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import torch
from storeutil import SUPPORT, Spawned
from weightserver import model

from agang._weights.publisher import WeightPublisher
from agang._weights.report import PushReport

HOST = socket.gethostname()
PUSH_TIMEOUT = 2.0
#: The recovery the publisher promises after a deadline, and this machine's slack.
RECOVERY = 4.0
SLACK = 1.5
START_SECONDS = 60.0
#: A push admits the subscribers registered a publisher's beat (0.2 s) before it.
#: Ten beats: a loaded machine may hold the publisher's beat thread back past one or two,
#: and a joiner that is never admitted still fails at once.
ADMISSION = 2.0


class Server(Spawned):
    """One weightserver process, its stdout as JSON events."""

    def __init__(
        self,
        started: list[subprocess.Popen[str]],
        *arguments: str,
        via: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        argv = [str(SUPPORT / "weightserver.py"), *arguments]
        super().__init__(started, argv, stdin=True, via=via, env=env)

    def event(self, *kinds: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.out.next(left)
            except AssertionError:
                break
            if line.startswith("{"):
                event: dict[str, Any] = json.loads(line)
                if event["event"] in kinds:
                    return event
        raise AssertionError(
            f"no {kinds} event within {timeout} s; stdout: {self.out.seen[-10:]}; "
            f"stderr: {self.err.rest(1)[-20:]}"
        )

    def opened(self) -> int:
        event = self.event("opened", "refused", timeout=START_SECONDS)
        assert event["event"] == "opened", event
        return int(event["pid"])

    def received(self, version: int) -> None:
        event = self.event("received", "failed")
        assert event == {"event": "received", "version": version, "exact": True}, event

    def send(self, line: str) -> None:
        """One line to its stdin (``--on-stdin``: open now)."""
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()


def serve(
    started: list[subprocess.Popen[str]],
    store: str,
    name: str,
    *extra: str,
    via: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Server:
    return Server(started, "serve", store, "w", name, *extra, via=via, env=env)


async def push_model(
    publisher: WeightPublisher,
    weights: dict[str, torch.Tensor],
    version: int,
    *,
    timeout: float | None = None,  # noqa: ASYNC109  # the push's own deadline
    **shape: int,
) -> PushReport:
    """Pushes ``weightserver.model(version, **shape)``, written into the publisher's
    ``weights`` (the tensors it opened with) first, as a trainer's step would."""
    for name, value in model(version, **shape).items():
        weights[name].copy_(value)
    return await publisher.push(version, timeout=timeout)


async def push(publisher: WeightPublisher, version: int, **kwargs: Any) -> PushReport:
    """:func:`push_model` into the tensors a publisher of ``open_publisher`` opened with."""
    weights = dict(zip(model(0), publisher._buckets._tensors, strict=True))
    return await push_model(publisher, weights, version, **kwargs)


async def open_publisher(store: str, deadline: float = 20.0) -> WeightPublisher:
    """The test's publisher on channel "w"; ``deadline``: each push's, in seconds."""
    return await WeightPublisher.open(model(0), store=store, channel="w", timeout=deadline)


async def until_pending(publisher: WeightPublisher, name: str) -> None:
    """Waits until ``publisher`` has read ``name``'s registration (a joiner its next push
    admits), polling every 50 ms, in place of a fixed wait of ``ADMISSION``; a joiner
    never read in five times that fails the test here."""
    fleet = publisher._fleet
    give_up_at = time.monotonic() + 5 * ADMISSION
    while True:
        with fleet._lock:
            if any(member.name == name for member in fleet._pending.values()):
                return
        assert time.monotonic() < give_up_at, f"{name} was not read within {5 * ADMISSION} s"
        await anyio.sleep(0.05)


async def push_until_delivered(publisher: WeightPublisher, first: int, name: str) -> PushReport:
    """Pushes ``first``, ``first + 1``, ... until ``name`` gets one (its re-registration
    may land after a push began), at most 10 times in 20 s."""
    give_up_at = time.monotonic() + 20.0
    for version in range(first, first + 10):
        report = await push(publisher, version)
        if name in report.delivered or time.monotonic() > give_up_at:
            return report
        await anyio.sleep(0.3)
    return report
