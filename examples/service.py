"""A small asyncio service on a gang: health from the first second, sums on demand.

Every rank serves ``GET /health`` on 127.0.0.1 before it waits for its peers, so a
load balancer or an orchestrator sees the process at once (a starlette app served by
uvicorn on the rank's own event loop: ``pip install -e '.[web]'``)::

    {"status": "starting" | "ready" | "failed", "rank": 0, "world_size": 2, "error": null}

Rank 0 is the front door: ``GET /sum?value=1.5`` makes every rank take part in one
all_reduce (rank 0 contributes the value, every other rank its rank number) and
``GET /stop`` (or SIGTERM/SIGINT) makes every rank close the gang and exit 0. If the gang
cannot be set up within ``--timeout`` seconds, /health reports "failed" with the error
(which names the missing ranks) for ``--linger`` seconds, then the process exits 1.

Run on two local ranks (ports 8000 + LOCAL_RANK, or AGANG_SERVICE_PORT + LOCAL_RANK)::

    torchrun --standalone --nproc-per-node 2 examples/service.py
    curl 127.0.0.1:8000/health
    curl '127.0.0.1:8000/sum?value=1.5'
    curl 127.0.0.1:8000/stop

How it works: each rank runs a command loop that awaits
``gang.broadcast_objects([cmd], source_rank=0, timeout=math.inf)``; rank 0's HTTP handlers
put commands on an asyncio.Queue that rank 0's loop broadcasts, so every rank runs the
same collectives in the same order. uvicorn serves the app as a task of the same loop
(``uvicorn.Server.serve``, its own signal handlers left out: SIGTERM and SIGINT are the
service's), on a socket the service binds first, so a taken port fails at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

if TYPE_CHECKING:
    import agang

log = logging.getLogger("agang.service")
HOST = "127.0.0.1"


class Service:
    """The state shared by the HTTP handlers and the command loop of one rank."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.status = "starting"
        self.error: str | None = None
        self.missing_ranks: list[int] = []
        self.gang: agang.Gang | None = None
        self.commands: asyncio.Queue[tuple[dict[str, Any], asyncio.Future[Any] | None]]
        self.commands = asyncio.Queue()
        self.stopping = False

    def health(self) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {
            "status": self.status,
            "rank": self.rank,
            "world_size": self.world_size,
            "error": self.error,
        }
        if self.missing_ranks:
            body["missing_ranks"] = self.missing_ranks
        return 200, body

    def request_stop(self) -> None:
        """Rank 0 only: tells every rank to stop, after the commands already queued."""
        if not self.stopping:
            self.stopping = True
            self.commands.put_nowait(({"op": "stop"}, None))

    # The HTTP routes: each answers JSON.

    async def get_health(self, request: Request) -> JSONResponse:
        status, body = self.health()
        return JSONResponse(body, status_code=status)

    async def get_sum(self, request: Request) -> JSONResponse:
        if self.rank != 0:
            return JSONResponse({"error": "/sum is served by rank 0 only"}, status_code=404)
        try:
            value = float(request.query_params["value"])
        except (KeyError, ValueError):
            return JSONResponse({"error": "usage: /sum?value=<float>"}, status_code=400)
        if self.status != "ready" or self.stopping:
            return JSONResponse({"error": f"the gang is {self.status}"}, status_code=503)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.commands.put_nowait(({"op": "sum", "value": value}, reply))
        try:
            total = await reply
        except Exception as error:  # reported to the client
            return JSONResponse({"error": str(error)}, status_code=503)
        return JSONResponse({"value": value, "sum": total, "world_size": self.world_size})

    async def get_stop(self, request: Request) -> JSONResponse:
        if self.rank != 0:
            return JSONResponse({"error": "/stop is served by rank 0 only"}, status_code=404)
        self.request_stop()
        return JSONResponse({"status": "stopping"})

    def app(self) -> Starlette:
        async def error(request: Request, exc: Exception) -> JSONResponse:
            assert isinstance(exc, HTTPException)
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

        routes = [
            Route("/health", self.get_health),
            Route("/sum", self.get_sum),
            Route("/stop", self.get_stop),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: error})

    async def command_loop(self, gang: agang.Gang) -> None:
        """Runs on every rank: receive rank 0's next command, then run its collectives."""
        while True:
            reply: asyncio.Future[Any] | None = None
            if gang.rank == 0:
                command, reply = await self.commands.get()
            else:
                command = None
            try:
                (command,) = await gang.broadcast_objects(
                    [command], source_rank=0, timeout=math.inf
                )
                if command["op"] == "stop":
                    log.info("stop: closing the gang")
                    return
                if command["op"] == "sum":
                    torch = sys.modules["torch"]
                    mine = command["value"] if gang.rank == 0 else float(gang.rank)
                    total = await gang.all_reduce(torch.tensor([mine], dtype=torch.float64))
                    log.info("sum: contributed %g, total %g", mine, total.item())
                    if reply is not None and not reply.done():
                        reply.set_result(total.item())
            except BaseException as error:
                if reply is not None and not reply.done():
                    reply.set_exception(RuntimeError(f"the command failed: {error}"))
                raise


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: SIGTERM and SIGINT are the service's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_http(app: Starlette, port: int) -> AsyncIterator[int]:
    """Serves ``app`` on HOST:``port`` (0: a free port) on this event loop, within the
    block; yields the port."""
    sock = socket.create_server((HOST, port))  # a taken port raises here, at once
    config = uvicorn.Config(
        app,
        log_config=None,  # the service's logging, not uvicorn's
        log_level="warning",
        access_log=False,
        lifespan="off",
        http="h11",  # named: no look for other HTTP or WebSocket stacks at start
        ws="none",
        proxy_headers=False,
        timeout_graceful_shutdown=2,
    )
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        for _ in range(500):  # up to 5 s for the app to be served
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # its error, if it failed to start
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True  # uvicorn looks every 0.1 s, then closes its connections
        await asyncio.wait({task}, timeout=5.0)
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            log.warning("the HTTP server failed: %r", task.exception())
        sock.close()


def import_torch_and_agang() -> Any:
    """Imports torch, then agang (on a thread: seconds of work); returns agang."""
    importlib.import_module("torch")
    return importlib.import_module("agang")


async def main(argv: list[str] | None = None) -> int:
    env = os.environ
    local_rank = int(env.get("LOCAL_RANK", "0"))
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(env.get("AGANG_SERVICE_PORT", "8000")) + local_rank,
        help="HTTP port on 127.0.0.1: $AGANG_SERVICE_PORT or 8000, plus LOCAL_RANK",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="init deadline (s)")
    parser.add_argument("--linger", type=float, default=5.0, help="serve 'failed' this long")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args(argv)

    service = Service(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")))
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None

    def on_signal(signum: int) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        if service.gang is None:  # still in init: give up on it
            main_task.cancel()
            return
        if service.rank == 0:
            service.request_stop()
        # Give rank 0's "stop" a moment to arrive; then stop waiting for it.
        loop.call_later(3.0, main_task.cancel)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    async with serve_http(service.app(), args.port) as port:
        log.info("health on http://%s:%d/health", HOST, port)
        # torch takes seconds to import: do it off the loop, so /health answers meanwhile.
        # (agang imports torch lazily, in init, which would import it on the loop.)
        try:
            agang = await asyncio.to_thread(import_torch_and_agang)
        except asyncio.CancelledError:
            return 0
        try:
            service.gang = await agang.init(timeout=args.timeout)
        except agang.GangInitError as error:
            service.status, service.error = "failed", str(error)
            service.missing_ranks = list(error.missing_ranks)
            log.error("init failed; serving 'failed' for %g s: %s", args.linger, error)
            await asyncio.sleep(args.linger)
            return 1
        except asyncio.CancelledError:
            return 0
        gang = service.gang
        service.status = "ready"
        log.info("ready: rank %d of %d on %s", gang.rank, gang.size, gang.backend)
        try:
            await service.command_loop(gang)
        except asyncio.CancelledError:
            log.info("stopped without rank 0's stop command")
        except Exception as error:  # a failed gang: report, linger, exit 1
            service.status, service.error = "failed", str(error)
            log.error("the gang failed; serving 'failed' for %g s: %s", args.linger, error)
            await asyncio.sleep(args.linger)
            await gang.close()
            return 1
        await gang.close()
        return 0


if __name__ == "__main__":
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(levelname)s %(message)s",
    )
    if "--uvloop" in sys.argv[1:]:
        import uvloop

        sys.exit(uvloop.run(main()))
    sys.exit(asyncio.run(main()))
