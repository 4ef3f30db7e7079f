"""A private world's set-up, cancelled (``agang._setup.private_world``, rule 3): the
wait stops at once, and a gang the set-up thread made after all is closed, never left
holding the process's one world. On fakes: a formation that blocks on an event."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from agang._setup import private_world

pytestmark = pytest.mark.anyio


class Made:
    """A stand-in for the gang a formation returns."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close_sync(self) -> None:
        self.closed.set()


async def test_a_gang_made_after_a_cancel_is_closed() -> None:
    release = threading.Event()
    made = Made()

    def form(deadline: float) -> Made:
        release.wait(10)
        return made

    with anyio.move_on_after(0.1) as scope:
        await private_world._formed_within(form, 5.0)  # type: ignore[arg-type]
    assert scope.cancelled_caught
    release.set()  # the formation finishes after its caller gave up
    assert made.closed.wait(5)


async def test_a_gang_handed_over_is_left_open() -> None:
    made = Made()
    gang = await private_world._formed_within(lambda deadline: made, 5.0)  # type: ignore[arg-type,return-value]
    assert gang is made
    await anyio.sleep(0.05)
    assert not made.closed.is_set()


async def test_a_formation_gets_a_deadline_that_many_seconds_ahead() -> None:
    seen: list[float] = []

    def form(deadline: float) -> Made:
        seen.append(deadline - time.monotonic())
        return Made()

    await private_world._formed_within(form, 30.0)  # type: ignore[arg-type]
    assert 25.0 < seen[0] <= 30.0


async def test_a_formation_that_fails_raises_its_error() -> None:
    def form(deadline: float) -> Made:
        raise RuntimeError("no members came")

    with pytest.raises(RuntimeError, match="no members came"):
        await private_world._formed_within(form, 5.0)  # type: ignore[arg-type]
