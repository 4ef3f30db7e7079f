"""A world of Gloo ranks that stays up and runs one request after another.

Starting a world costs seconds; one example of a property test, tens of milliseconds. So
a test fixture starts one world with ``run_world`` (in a background thread) and sends it
each example through a TCPStore that the test process hosts on 127.0.0.1 (port 0, so the
kernel picks a free port with no race):

1. The test sets ``request/<n>`` to a pickled request; a pickled ``None`` means "stop".
2. Every rank waits for ``request/<n>``, runs ``handle(gang, request)``, and sets
   ``reply/<n>/<rank>`` to ``("ok", result)`` or ``("error", traceback)``. After an
   error it stops serving: its gang may be broken, and a later request could hang on it.
3. Every wait is bounded. A rank waits at most ``IDLE_SECONDS`` for the next request;
   the test waits at most ``reply_timeout`` for the replies, checking every few seconds
   that the world is still running; ``run_world`` kills the ranks at its own deadline.
4. Once a request fails or times out, the world is broken: that request, and every
   later one, raises ``WorldBrokenError`` naming the request that broke it, with each
   rank's traceback. (Requests are valid programs: a failure is a bug in agang.)

It lives outside the test module for the same reason as ``conformance_program.py``:
``run_world`` spawns its ranks, which import ``serve`` by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, final

import anyio.to_thread
import torch.distributed as dist

import agang
from agang.testing import run_world

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store  # what torch.distributed re-exports

PORT_VARIABLE = "AGANG_PROPERTY_WORLD_PORT"
# How long a rank waits for the next request before it gives up on the test process.
IDLE_SECONDS = 120.0
# How often the test, while it waits for replies, checks that the world still runs.
_POLL_SECONDS = 5.0

Handler = Callable[[agang.Gang, Any], Awaitable[Any]]


class WorldBrokenError(BaseException):
    """A request failed, or got no reply in time, so the world can serve no more.

    Not an ``Exception``, so that Hypothesis lets it through at once rather than shrink
    the example: every later example would fail on the broken world as well, and the
    "smallest failing program" found that way would be a false lead. pytest reports it
    as the test's failure, naming the request that broke the world.
    """


# The ranks' side.


async def serve(gang: agang.Gang, handle: Handler) -> int:
    """Runs each request with ``handle`` until told to stop; returns how many it ran."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        int(os.environ[PORT_VARIABLE]),
        is_master=False,
        timeout=timedelta(seconds=IDLE_SECONDS),
    )
    number = 0
    while True:
        request = await anyio.to_thread.run_sync(_take, store, f"request/{number}")
        if request is None:
            return number
        try:
            reply = ("ok", await handle(gang, request))
        except Exception:
            reply = ("error", traceback.format_exc())
        await anyio.to_thread.run_sync(_put, store, f"reply/{number}/{gang.rank}", reply)
        number += 1
        if reply[0] == "error":
            return number


def _take(store: Store, key: str) -> Any:
    store.wait([key])  # at most the store's timeout: IDLE_SECONDS
    return pickle.loads(store.get(key))


def _put(store: Store, key: str, value: Any) -> None:
    store.set(key, pickle.dumps(value))  # type: ignore[arg-type]  # bytes: the stubs say str


# The test's side.


@final
class ServedWorld:
    """``size`` Gloo ranks that run ``handle(gang, request)`` for each request sent.

    Example:
        >>> with ServedWorld(run_program, 2) as world:
        ...     outcomes = world.request(program)  # one result per rank
    """

    def __init__(
        self,
        handle: Handler,
        size: int,
        *,
        async_backend: str = "asyncio",
        lifetime: float = 300.0,
        op_timeout: float = 30.0,
        init_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.size = size
        self.requests: list[Any] = []  # every request sent, in order
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False
        )
        self._broken: str | None = None
        self._ended: str | None = None  # once run_world returned: "ok", or its traceback
        self._thread = threading.Thread(
            target=self._run,
            kwargs={
                "fn": functools.partial(serve, handle=handle),
                "world_size": size,
                "async_backend": async_backend,
                "timeout": lifetime,
                "op_timeout": op_timeout,
                "env": {PORT_VARIABLE: str(self._store.port)},
                "init_options": init_options,
            },
            name=f"served-world-{size}",
            daemon=True,  # run_world's own deadline bounds it; never block exit on it
        )
        self._thread.start()

    def __enter__(self) -> ServedWorld:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def request(self, request: Any, *, reply_timeout: float = 60.0) -> list[Any]:
        """Has every rank run ``request``; returns their results, indexed by rank.

        Raises:
            WorldBrokenError: A rank failed (its traceback is in the message), a reply
                took more than ``reply_timeout`` seconds, or an earlier request broke
                the world.
        """
        if self._broken is not None:
            raise WorldBrokenError(f"an earlier request broke the world: {self._broken}")
        number = len(self.requests)
        self.requests.append(request)
        _put(self._store, f"request/{number}", request)
        deadline = time.monotonic() + reply_timeout
        replies = [self._reply(number, rank, deadline) for rank in range(self.size)]
        failures = [
            f"--- rank {rank} ---\n{text}"
            for rank, (status, text) in enumerate(replies)
            if status != "ok"
        ]
        if failures:
            self._break(number, "\n".join(failures))
        self._store.delete_key(f"request/{number}")  # every rank has read it
        return [result for _, result in replies]

    def close(self, timeout: float = 60.0) -> None:
        """Tells the ranks to stop and waits for ``run_world`` to return."""
        _put(self._store, f"request/{len(self.requests)}", None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise WorldBrokenError(f"the world did not stop within {timeout:g} s of being told")
        if self._ended != "ok" and self._broken is None:
            raise WorldBrokenError(f"the world failed:\n{self._ended}")

    def _run(self, **run_world_arguments: Any) -> None:
        try:
            run_world(**run_world_arguments)
        except BaseException:
            self._ended = traceback.format_exc()
        else:
            self._ended = "ok"

    def _reply(self, number: int, rank: int, deadline: float) -> tuple[str, Any]:
        key = f"reply/{number}/{rank}"
        while not self._store.check([key]):
            remaining = deadline - time.monotonic()
            if not self._thread.is_alive():
                self._break(number, f"the world ended without replying:\n{self._ended}")
            if remaining <= 0:
                self._break(number, f"rank {rank} did not reply in time")
            # A timeout here means "not yet": check the world and the deadline again.
            with contextlib.suppress(dist.DistStoreError):
                self._store.wait([key], timedelta(seconds=min(_POLL_SECONDS, remaining)))
        reply: tuple[str, Any] = _take(self._store, key)
        self._store.delete_key(key)
        return reply

    def _break(self, number: int, why: str) -> NoReturn:
        self._broken = f"request {number}, {self.requests[number]!r}:\n{why}"
        raise WorldBrokenError(self._broken)
