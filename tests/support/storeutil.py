"""An ``agang store`` process for tests, line-by-line readers of processes' output, and a
store client whose key another client deletes as it is read."""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

SUPPORT = Path(__file__).resolve().parent  # tests/support
ROOT = SUPPORT.parents[1]  # the repository
# For a test file run as a script (its own folder first on sys.path): agang, and these
# helpers by name.
PYTHONPATH = os.pathsep.join([str(ROOT), str(SUPPORT)])


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        and not name.startswith("TORCHELASTIC_")
    }
    env.update(PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **extra)
    return env


class Lines:
    """A stream of a process, line by line, read on a thread (bounded waits)."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float) -> str:
        return self.wait_for("", timeout)

    def wait_for(self, text: str, timeout: float) -> str:
        """The next line holding ``text``, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                self._queue.put(None)  # the end stays the end
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(
            f"no line with {text!r} within {timeout} s; the last: {self.seen[-20:]}"
        )

    def rest(self, timeout: float) -> list[str]:
        """Every line up to the end of the stream (the process exited), within ``timeout``."""
        with contextlib.suppress(AssertionError):
            self.wait_for("\0never", timeout)
        return self.seen


class Spawned:
    """A Python process of a test, listed in ``started`` (which the test ends), its
    stdout and stderr read on threads; ``stdin`` gives it a pipe to write to; ``via``
    runs it through a command that then execs it under the same pid (``ip netns exec
    NAMESPACE``: on a node of ``tests/support/netns.py``); ``env`` adds to
    :func:`clean_env`."""

    def __init__(
        self,
        started: list[subprocess.Popen[str]],
        argv: list[str],
        *,
        stdin: bool = False,
        via: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [*via, sys.executable, *argv],
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(**(env or {})),
        )
        started.append(self.process)
        self.out = Lines(self.process.stdout)
        self.err = Lines(self.process.stderr)

    def kill(self) -> None:
        """SIGKILL by its pid; returns once it is gone and its pipes are closed (their
        readers saw the end), so that nothing of it stays in the test's process."""
        self.process.kill()
        self.process.wait(timeout=30)
        self.out.rest(10)
        self.err.rest(10)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class Store(Spawned):
    """An ``agang store`` process, its stdout and stderr read on threads."""

    def __init__(
        self, started: list[subprocess.Popen[str]], *arguments: str, via: Sequence[str] = ()
    ) -> None:
        super().__init__(started, ["-m", "agang", "store", *arguments], via=via)

    def signal(self, signum: int) -> None:
        self.signalled_at = time.monotonic()
        self.process.send_signal(signum)

    def stopped(self) -> dict[str, Any]:
        """The exit status, how long it took since the signal, the last line, the log."""
        status = self.process.wait(timeout=30)
        took = time.monotonic() - self.signalled_at
        return {
            "status": status,
            "took": took,
            "last": self.out.rest(5)[-1],
            "log": self.err.rest(5),
        }


def wait_until_stopped(pid: int, seconds: float = 5.0) -> None:
    """Returns once ``pid`` is stopped: under load a SIGSTOP can take effect late."""
    give_up_at = time.monotonic() + seconds
    while time.monotonic() < give_up_at:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} was not stopped within {seconds} s")


class DeletedAsItIsRead:
    """``store`` (a c10d client), where ``other`` (another client) deletes ``key`` right
    after this one's first op on it returned: a reader racing a deleter, such as a
    subscriber's upstream reading its drop while the publisher's fleet deletes it."""

    def __init__(self, store: Any, other: Any, key: str) -> None:
        self.store = store
        self._other = other
        self._key = key
        self.deleted = False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        op = getattr(self.store, name)

        def call(*args: Any) -> Any:
            result = op(*args)
            keys = args[0] if args and isinstance(args[0], list) else args[:1]
            if self._key in keys and not self.deleted:
                self.deleted = True
                self._other.delete_key(self._key)
            return result

        return call
