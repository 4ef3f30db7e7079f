"""How init retries transient failures: a policy users compose from tenacity's parts.

Rules:
1. Transient is a type: ``TransientSetupError``, with the original error as its
   ``__cause__``, and ``PortInUseError`` on a port agang chose itself. agang's own
   transient conditions (a store that is closing, a round that ended) raise it directly;
   c10d's errors become it in one place, ``transient_from_c10d``, applied where c10d
   is called (``call_c10d``). Everything else (bad environment, disagreeing world
   sizes, a duplicate rank, a taken port the user fixed, a store wait that outlived the
   deadline) fails at once, whatever its message says.
2. The init deadline always applies on top of the user's ``stop``: no policy can make
   init outlive its ``timeout``.
3. ``sleep`` is injectable, so tests never really wait.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import tenacity
import torch.distributed as dist
from tenacity.stop import stop_base
from tenacity.wait import wait_base

P = ParamSpec("P")
T = TypeVar("T")


class TransientSetupError(Exception):
    """A set-up step failed in a way another attempt may not: the store was not up yet,
    went away, or belonged to a round that is over. Its ``__cause__`` is the original
    error, when there is one."""


class PortInUseError(RuntimeError):
    """The store port is taken; transient only when agang chose the port."""

    def __init__(self, message: str, *, port_is_ours: bool) -> None:
        super().__init__(message)
        self.port_is_ours = port_is_ours


def is_address_in_use(error: BaseException) -> bool:
    """Whether c10d failed to host a store because its port is taken.

    c10d (torch 2.13) raises this as a ``DistNetworkError``, the type of every other
    network failure too, with no errno attribute: only its text says which it is
    ("... name: EADDRINUSE, message: address already in use").
    """
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return True  # agang's own listener (rendezvous rule 7)
    return isinstance(error, dist.DistNetworkError) and "address already in use" in (
        str(error).lower()
    )


# c10d gives no type for these: Gloo's transport, while a process group is being made,
# raises a plain RuntimeError (measured with torch 2.13: a peer killed mid-creation
# gives "[.../gloo/transport/tcp/pair.cc:...] Connection closed by peer ...", which is
# permanent: the peer crashed). A connection the OS refused or reset is worded with
# the OS's error text, and is transient. This is the only text test of the module.
_PLAIN_RUNTIME_ERROR_TRANSIENT = ("connection refused", "connection reset by peer")


def transient_from_c10d(error: BaseException) -> TransientSetupError | None:
    """The transient error ``error``, raised by a c10d call, amounts to, or None if permanent.

    What torch 2.13 raises (measured against a real ``TCPStore``):
    - a client connecting to a port nobody listens on, or to an unknown host: c10d
      retries until its timeout, then ``DistNetworkError`` ("The client socket has timed
      out after ... while trying to connect to ...");
    - a store host that dies while a client calls ``get``, ``check``, ``add`` or waits:
      ``DistNetworkError`` ("Failed to recv, got 0 bytes. Connection was likely
      closed ...");
    - a listener that is not a store and drops the client: ``DistNetworkError``
      ("Connection reset by peer");
    - a host whose port is taken: ``DistNetworkError`` too (see ``is_address_in_use``),
      not transient by itself: ``PortInUseError`` decides;
    - a store wait that ran out of time (a rank missing when ``init_process_group``
      waits for it): ``DistStoreError`` ("wait timeout after ..."). That wait already
      ran up to the init deadline, so it is permanent.
    - Gloo's transport while a group is made: a plain ``RuntimeError``; only its text
      tells a refused or reset connection (transient) from a crashed peer.
    Builtin ``ConnectionError`` subclasses are transient too (a socket-level failure
    from any layer).
    """
    if isinstance(error, TransientSetupError):
        return error
    if isinstance(error, dist.DistNetworkError):
        if is_address_in_use(error):
            return None
        return TransientSetupError(f"The store connection failed: {error}")
    if isinstance(error, dist.DistError):
        return None  # DistStoreError (a wait timed out) and the rest: permanent
    if isinstance(error, ConnectionError):
        return TransientSetupError(f"The connection failed: {error}")
    if type(error) is RuntimeError:
        text = str(error).lower()
        if any(words in text for words in _PLAIN_RUNTIME_ERROR_TRANSIENT):
            return TransientSetupError(f"The connection failed: {error}")
    return None


def call_c10d(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Calls ``fn(*args, **kwargs)``, a c10d call, raising its transient failures as
    ``TransientSetupError`` (from the original error) and the rest unchanged.

    Use it around every c10d call inside ``retrying``, which retries by type only.
    Pass the arguments rather than a closure over them: a closure outlives a failure's
    cleared frames, and with it whatever it holds (a hosted store and its port).
    """
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        transient = transient_from_c10d(error)
        if transient is None or transient is error:
            raise
        raise transient from error


def _default_wait() -> wait_base:
    return tenacity.wait_exponential(multiplier=0.1, max=2.0) + tenacity.wait_random(0, 0.1)


@dataclass(frozen=True)
class RetryPolicy:
    """When and how [`agang.init`][agang.init] retries a transient failure.

    Args:
        stop: When to give up, from ``tenacity.stop``; the init deadline always applies too.
        wait: How long to wait between attempts, from ``tenacity.wait``.
        sleep: The function that waits; tests pass one that returns at once.

    Example:
        <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
        ```python
        from tenacity import stop_after_attempt, wait_fixed
        policy = agang.RetryPolicy(stop=stop_after_attempt(5), wait=wait_fixed(0.5))
        gang = await agang.init(retry=policy)
        ```
    """

    stop: stop_base = field(default_factory=lambda: tenacity.stop_never)
    wait: wait_base = field(default_factory=_default_wait)
    sleep: Callable[[float], None] = time.sleep


class _StopAtDeadline(stop_base):
    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return time.monotonic() >= self._deadline


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is worth another attempt (rule 1): by its type alone."""
    if isinstance(error, PortInUseError):
        return error.port_is_ours
    return isinstance(error, TransientSetupError)


def retrying(
    policy: RetryPolicy,
    deadline: float,
    *,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> tenacity.Retrying:
    """A tenacity controller for ``policy`` that never passes ``deadline`` (rule 2).

    It retries ``TransientSetupError`` and a ``PortInUseError`` on a port
    agang chose, nothing else: wrap the c10d calls of an attempt in ``call_c10d``
    so that their transient failures have that type.

    Args:
        on_retry: Called before each wait with the number of the attempt that failed, its
            error and the seconds until the next one (to say so in one line).

    Example:
        <!-- not-run: an internal helper, inside a c10d world of processes -->
        ```python
        for attempt in retrying(RetryPolicy(), deadline):
            with attempt:
                group = call_c10d(dist.new_group, ranks)
        ```
    """
    return tenacity.Retrying(
        stop=policy.stop | _StopAtDeadline(deadline),
        wait=policy.wait,
        sleep=policy.sleep,
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=None if on_retry is None else _before_sleep(on_retry),
        reraise=True,
    )


def _before_sleep(
    on_retry: Callable[[int, BaseException, float], None],
) -> Callable[[tenacity.RetryCallState], None]:
    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        pause = state.next_action.sleep if state.next_action is not None else 0.0
        if error is not None:
            on_retry(state.attempt_number, error, pause)

    return before_sleep
