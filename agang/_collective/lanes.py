"""A gang's lanes by name: each made once, on first call, and shared by later calls.

Making a lane is a collective call; two tasks asking for the same name at once must get
one lane, so the first registers a future that the others await. A failed making is
forgotten, so that a later call may try again.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from agang._runtime.future import Future

if TYPE_CHECKING:
    from agang._gang import Gang


class Lanes:
    """The lanes of one gang. ``lock`` is the gang's."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._lanes: dict[str, tuple[bool, Future[Gang]]] = {}

    async def get_or_make(
        self, name: str, high_priority: bool, make: Callable[[], Awaitable[Gang | None]]
    ) -> Gang:
        """The lane ``name``, made by ``make()`` if no call made (or is making) it."""
        with self._lock:
            known = self._lanes.get(name)
            if known is None:
                making: Future[Gang] = Future(f"lane '{name}'")
                self._lanes[name] = (high_priority, making)
        if known is not None:
            priority, made = known
            if priority != high_priority:
                raise ValueError(
                    f"`high_priority` must match the lane '{name}' made earlier "
                    f"({priority}), but is {high_priority} instead."
                )
            return await made
        try:
            lane = await make()
        except BaseException as exc:
            with self._lock:
                self._lanes.pop(name, None)
            making._finish(None, exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            raise
        assert lane is not None  # every rank is a member of a lane
        making._finish(lane, None)
        return lane
