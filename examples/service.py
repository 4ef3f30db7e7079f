"""A small asyncio service on a gang: health from the first second, sums on demand.

Every rank serves ``GET /health`` on 127.0.0.1 before it waits for its peers, so a
load balancer or an orchestrator sees the process at once::

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
same collectives in the same order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import math
import os
import signal
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    import agang

log = logging.getLogger("agang.service")

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}


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

    async def route(self, method: str, target: str) -> tuple[int, dict[str, Any]]:
        url = urlsplit(target)
        if method != "GET":
            return 404, {"error": f"no route for {method} {url.path}"}
        if url.path == "/health":
            return self.health()
        if url.path in ("/sum", "/stop") and self.rank != 0:
            return 404, {"error": f"{url.path} is served by rank 0 only"}
        if url.path == "/sum":
            try:
                value = float(parse_qs(url.query)["value"][0])
            except (KeyError, ValueError):
                return 400, {"error": "usage: /sum?value=<float>"}
            if self.status != "ready" or self.stopping:
                return 503, {"error": f"the gang is {self.status}"}
            reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.commands.put_nowait(({"op": "sum", "value": value}, reply))
            try:
                total = await reply
            except Exception as error:  # reported to the client
                return 503, {"error": str(error)}
            return 200, {"value": value, "sum": total, "world_size": self.world_size}
        if url.path == "/stop":
            self.request_stop()
            return 200, {"status": "stopping"}
        return 404, {"error": f"no route for {url.path}"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A minimal HTTP/1.1 handler: one request per connection, JSON replies."""
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request_line.decode("latin-1").split()
            if len(parts) < 2:
                status, body = 400, {"error": "bad request line"}
            else:
                status, body = await self.route(parts[0], parts[1])
            payload = (json.dumps(body) + "\n").encode()
            writer.write(
                f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                f"Connection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

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
    server = await asyncio.start_server(service.handle, "127.0.0.1", args.port)
    log.info("health on http://127.0.0.1:%d/health", args.port)
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

    async with server:
        # torch takes seconds to import: do it off the loop, so /health answers meanwhile.
        try:
            agang = await asyncio.to_thread(importlib.import_module, "agang")
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
