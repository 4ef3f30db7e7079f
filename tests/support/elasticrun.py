"""Elastic ranks that a test drives one command at a time, forked from one warm process.

Starting a Python process that imports torch costs about 1.5 s of CPU here; the fault
tests need dozens of ranks (every kill is followed by a replacement). So a *zygote*
(``python tests/support/elasticrun.py zygote``) imports torch and agang once and forks each rank
on request; a fork costs milliseconds. Each rank connects back to the test's
:class:`Control` socket (127.0.0.1), says hello with its pid, and then runs the commands
the test sends it (JSON lines), answering with events (JSON lines): ``init`` makes it
call ``agang.init(elastic=...)``, so the test chooses when a joiner arrives.

Every rank measures its event loop's lag all its life with a 10 ms ticker (``stats``
reports the p99), and ends when its control connection closes or after ``LIFETIME``
seconds (an alarm), so no rank outlives a test that died. The test kills ranks by pid;
the zygote reaps them and reports each exit status (``EXIT pid status``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from storeutil import Lines, Store, clean_env

LIFETIME = 120  # seconds: a rank's alarm, far beyond any test's use of it
TICK = 0.01


# -- the test's side ------------------------------------------------------------------


class Worker:
    """One rank's control connection: commands out, events in (bounded waits)."""

    def __init__(self, connection: socket.socket, hello: dict[str, Any], events: Any) -> None:
        self.connection = connection
        self.pid: int = hello["pid"]
        self.events: queue.Queue[dict[str, Any] | None] = events
        self.seen: list[dict[str, Any]] = []

    def send(self, do: str, **arguments: Any) -> None:
        self.connection.sendall((json.dumps({"do": do, **arguments}) + "\n").encode())

    def event(self, *what: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next event whose ``what`` is one of ``what``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                break
            if event is None:
                self.events.put(None)
                break
            self.seen.append(event)
            if event["what"] in what:
                return event
        raise AssertionError(f"pid {self.pid}: no {what} within {timeout} s; saw {self.seen}")

    def ask(self, do: str, *what: str, timeout: float = 30.0, **arguments: Any) -> dict[str, Any]:
        self.send(do, **arguments)
        return self.event(*what, timeout=timeout)


class Control:
    """The listening socket the ranks connect back to, and the zygote that forks them."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.zygote = subprocess.Popen(
            [sys.executable, __file__, "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=clean_env(),
        )
        self.out = Lines(self.zygote.stdout)
        self.out.wait_for("ZYGOTE ready", 60)
        self.pids: list[int] = []
        self.exits: dict[int, int] = {}

    def fork(self, **env: str) -> Worker:
        """A new rank with ``env`` added to its environment, connected and idle."""
        control = f"127.0.0.1:{self.listener.getsockname()[1]}"
        assert self.zygote.stdin is not None
        self.zygote.stdin.write(json.dumps({**env, "ELASTICRUN_CONTROL": control}) + "\n")
        self.zygote.stdin.flush()
        connection, _ = self.listener.accept()
        events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        reader = connection.makefile("r")
        hello = json.loads(reader.readline())
        threading.Thread(target=_read_events, args=(reader, events), daemon=True).start()
        self.pids.append(hello["pid"])
        return Worker(connection, hello, events)

    def exit_status(self, pid: int, timeout: float = 10.0) -> int:
        """``pid``'s exit status as the zygote reaped it (negative: the signal)."""
        deadline = time.monotonic() + timeout
        while pid not in self.exits:
            line = self.out.wait_for("EXIT ", max(0.01, deadline - time.monotonic()))
            _, reaped, status = line.split()
            self.exits[int(reaped)] = int(status)
        return self.exits[pid]

    def kill_all(self) -> None:
        """Ends every rank still running, by pid."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill_all()
        self.zygote.kill()
        self.zygote.wait(10)
        self.listener.close()


class Cluster:
    """An ``agang store`` and elastic ranks forked by ``control``'s zygote, all formed
    into epoch 0 (``init`` settings, some ranks' ``overrides``); ``close`` ends every
    process it started, by pid."""

    def __init__(
        self,
        control: Control,
        size: int,
        overrides: dict[int, dict[str, Any]] | None = None,
        env: dict[str, str] | None = None,
        own_hosts: bool = False,
        **init: Any,
    ) -> None:
        self.control = control
        self.size = size
        self.init = init
        self.env = env or {}  # more variables for every rank (AGANG_SIM_NCCL)
        # Each rank claims a host of its own (NCCL_HOSTID): real NCCL then takes two
        # ranks of one communicator on one GPU, over its socket transport.
        self.own_hosts = own_hosts
        self.started: list[subprocess.Popen[str]] = []
        self.pids: list[int] = []
        try:
            self.store = Store(self.started, "--port", "0", "--quiet")
            self.port = int(self.store.out.next(30).rsplit(":", 1)[1])
            self.workers = [self.fork(rank) for rank in range(size)]
            for rank, worker in enumerate(self.workers):
                worker.send("init", **{**init, **(overrides or {}).get(rank, {})})
            self.epochs = [worker.event("epoch") for worker in self.workers]
        except BaseException:
            self.close()
            raise

    def fork(self, rank: int) -> Worker:
        """A rank of this cluster, not yet in it (``join`` or ``init`` makes it call
        ``agang.init``)."""
        worker = self.control.fork(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            RANK=str(rank),
            WORLD_SIZE=str(self.size),
            LOCAL_RANK="0",
            **self.env,
            **({"NCCL_HOSTID": f"agang-rank-{len(self.pids)}"} if self.own_hosts else {}),
        )
        self.pids.append(worker.pid)
        return worker

    def join(self, worker: Worker, **init: Any) -> None:
        worker.send("init", **{**self.init, **init})

    def restart_store(self) -> None:
        """Kills the store by pid and starts a new, empty one on the same port, as a
        supervisor restarting it would; returns once it listens."""
        self.store.process.kill()
        self.store.process.wait(10)
        self.store = Store(self.started, "--port", str(self.port), "--quiet")
        self.store.out.next(30)

    def kill(self, *workers: Worker, signum: int = signal.SIGKILL) -> float:
        """Signals ``workers`` by pid; returns when (``time.monotonic()``)."""
        for worker in workers:
            os.kill(worker.pid, signum)
        return time.monotonic()

    def close(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.started:
            process.kill()
            process.wait(10)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_events(reader: Any, events: queue.Queue[dict[str, Any] | None]) -> None:
    try:
        for line in reader:
            events.put(json.loads(line))
    except OSError:
        pass
    events.put(None)


# -- the zygote -----------------------------------------------------------------------


def _zygote() -> None:
    import anyio  # noqa: F401  (imported once here, shared by every fork)
    import torch  # noqa: F401

    import agang  # noqa: F401

    def reap(signum: int, frame: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            os.write(1, f"EXIT {pid} {os.waitstatus_to_exitcode(status)}\n".encode())

    signal.signal(signal.SIGCHLD, reap)
    print("ZYGOTE ready", flush=True)
    for line in sys.stdin:
        env = json.loads(line)
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.update(env)
            code = 1
            try:
                from elasticworker import run

                code = run()
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)


if __name__ == "__main__":
    assert sys.argv[1:] == ["zygote"], sys.argv
    _zygote()
