"""The store the members meet at: connecting to it, and reading it.

Both membership features keep their state in a store that outlives every member (an
``agang store``), and every member reaches it through a client made here.

Rules (every call may block: call them off the event loop):
1. *Connecting* is retried until a deadline. Each attempt runs on a thread of its own,
   given up on at the deadline: where the store takes the connection and never answers
   (a stopped ``agang store``: the kernel accepts for it), the attempt blocks in c10d
   whatever its timeout. c10d's C++ log stays quiet meanwhile
   (``agang._backends.c10d.log``); each failed attempt is one INFO line of agang's.
   An attempt lasts at most ``ATTEMPT_SECONDS``: c10d's own retries sleep past their
   timeout (3.6 s for a 2 s one, measured on a refused port).
2. The error at the deadline names the store, how the attempts ended, and the feature
   that asked and what it needs of the store (``need``), so that a user of the weights
   is never told about elastic gangs.
3. *An op* of a client waits ``op_seconds`` at most. The weights' clients wait
   ``OP_SECONDS``: a server whose link came back after a cut of a few seconds had its
   first ops delayed past 2 s by TCP's retransmits, and failed though the store was
   there. Elastic set-up keeps the attempt's own timeout (its steps are bounded by
   the reform's deadline, on threads given up on there).
4. *A key that may be missing* is read in one op that never waits (``read``, ``lines``):
   a missing key is an answer (None, or no lines), not a wait. Never a ``get``, even
   after a ``check`` that found the key: another client may delete it in between (the
   publisher deletes a drop its subscriber reads at every beat), and c10d's ``get``
   then waits for the key for the client's whole timeout holding the client, so every
   thread that shares it waits too (a weights subscriber's beat, its close, and in one
   process the publisher's fleet and close: a test's close hung 35 s on one such read).
   The op is a ``compare_set`` that expects a value no one writes (``_ABSENT``): where
   the key is missing it writes nothing and answers that value back; else it answers
   the key's value (and where the key held that very value, writes it over with
   itself). One round trip, atomic: the value read is the key's at that instant.
"""

from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from agang._backends.c10d.log import quiet_c10d
from agang._backends.c10d.retry import TransientSetupError, call_c10d
from agang._errors import GangInitError, one_line
from agang._runtime import threads

log = logging.getLogger("agang.membership")

#: The longest one connection attempt lasts (rule 1).
ATTEMPT_SECONDS = 2.0
#: The longest a weights client's op waits (rule 3).
OP_SECONDS = 30.0


def parse_address(store: object, *, name: str) -> tuple[str, int]:
    """``store`` ("HOST:PORT", an IPv6 host in brackets) as a host and a port; raises
    naming the parameter ``name`` where it is not one."""
    if not isinstance(store, str):
        raise TypeError(
            f"`{name}` must be a str 'HOST:PORT', but is of type `{type(store).__name__}`."
        )
    host, sep, port_text = store.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"`{name}` must be 'HOST:PORT' (an agang store), but is {store!r}.")
    return host, int(port_text)


def address(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect(
    host: str,
    port: int,
    deadline: float,
    *,
    need: str,
    who: str = "this process",
    op_seconds: float | None = None,
) -> Any:
    """A client of the store at ``host:port``, retried until ``deadline`` (rule 1).

    Args:
        need: What the feature that asks needs of the store, as a sentence's subject
            and verb ("An elastic gang needs"), for the error (rule 2).
        who: Who connects, for the log.
        op_seconds: How long each op of the client may wait (None: an attempt's).

    Raises:
        GangInitError: No attempt succeeded before ``deadline`` (rule 2).
    """
    where = address(host, port)
    last: str | None = None  # the last failed attempt's error, in one line
    attempt = 0
    waiting = False  # the last attempt was given up on at the deadline
    with quiet_c10d():  # held here: a thread given up on must not keep it quiet
        while time.monotonic() < deadline:
            attempt += 1
            seconds = max(0.1, min(ATTEMPT_SECONDS, deadline - time.monotonic()))
            trying = threads.start_thread(
                functools.partial(_connect_once, host, port, seconds),
                name="connect to the store",
            )
            try:
                client = trying.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                waiting = True
                break
            except TransientSetupError as error:
                last = one_line(error.__cause__ or error).rstrip(".")
                log.info(
                    "agang: %s: attempt %d at the store %s failed: %s; retrying in 0.1 s.",
                    who,
                    attempt,
                    where,
                    last,
                )
                time.sleep(0.1)
            else:
                if op_seconds is not None:
                    client.set_timeout(timedelta(seconds=op_seconds))
                return client
    if attempt == 0:
        how = "none: no time was left"
    elif waiting:
        how = f"{attempt}; the last still under way" + (
            f", the one before failed with: {last}" if last is not None else ""
        )
    else:
        how = f"{attempt}; the last failed with: {last}"
    raise GangInitError(
        f"The store at {where} did not answer before the deadline (connection attempts: "
        f"{how}). {need} a store that outlives its members and answers them: is `agang "
        f"store` running there, and not stopped (a stopped one takes connections but "
        f"never answers)?"
    )


def _connect_once(host: str, port: int, seconds: float) -> Any:
    return call_c10d(
        dist.TCPStore,  # type: ignore[attr-defined]
        host,
        port,
        is_master=False,
        timeout=timedelta(seconds=seconds),
    )


#: What ``read`` expects under a key: no value agang or c10d writes (rule 4).
_ABSENT = "\x00agang: no such key\x00"
_ABSENT_BYTES = _ABSENT.encode()


def read(store: Any, key: str) -> str | None:
    """``key``'s value, or None where the store does not hold it: one op that never
    waits, even where another client deletes the key meanwhile (rule 4)."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT_BYTES else value.decode()


def lines(store: Any, key: str) -> list[str]:
    """The non-empty lines under ``key``, none where it is missing (rule 4)."""
    text = read(store, key)
    return [] if text is None else [line for line in text.splitlines() if line]
