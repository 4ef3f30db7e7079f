"""Waiting on c10d Work that has no future (Gloo's send, recv and reduce_scatter:
"Work::getFuture not implemented"): one thread per gang and kind waits on them in issue
order, so a later op that finishes before an earlier one is reported after it (late,
never wrong).
"""

from __future__ import annotations

import queue
from typing import Any

from agang._backends.contract import Done
from agang._runtime import threads


class WorkWaiter:
    """A thread that waits on Work in issue order, for Work that has no future."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Done] | None] = queue.SimpleQueue()
        threads.start_daemon(self._run, name=f"agang-wait {name}")

    def watch(self, work: Any, done: Done) -> None:
        self._queue.put((work, done))

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done = item
            try:
                work.wait()
            except Exception as exc:
                done(exc)
            else:
                done(None)
