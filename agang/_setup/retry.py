"""How init retries transient failures: a policy users compose from tenacity's parts.

Rules:
1. Only transient errors are retried: the store not up yet (connection refused or timed
   out while connecting), a connection reset, and "address already in use" on a port
   agang chose itself. Everything else (bad environment, disagreeing world sizes, a
   duplicate rank, a taken port the user fixed) fails at once.
2. The init deadline always applies on top of the user's ``stop``: no policy can make
   init outlive its ``timeout``.
3. ``sleep`` is injectable, so tests never really wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tenacity
from tenacity.stop import stop_base
from tenacity.wait import wait_base

_TRANSIENT = (
    "connection refused",
    "connection reset",
    "timed out after",  # c10d's client connect timeout
    "failed to connect",
    "broken pipe",
    "failed to recv",  # the store went away mid-check-in: try the next one
    "likely closed",
)


def _default_wait() -> wait_base:
    return tenacity.wait_exponential(multiplier=0.1, max=2.0) + tenacity.wait_random(0, 0.1)


@dataclass(frozen=True)
class RetryPolicy:
    """When and how :func:`agang.init` retries a transient failure.

    Args:
        stop: When to give up, from ``tenacity.stop``; the init deadline always applies too.
        wait: How long to wait between attempts, from ``tenacity.wait``.
        sleep: The function that waits; tests pass one that returns at once.

    Example:
        >>> from tenacity import stop_after_attempt, wait_fixed
        >>> policy = agang.RetryPolicy(stop=stop_after_attempt(5), wait=wait_fixed(0.5))
        >>> gang = await agang.init(retry=policy)
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
    """Whether ``error`` is worth another attempt (rule 1)."""
    if isinstance(error, PortInUseError):
        return error.port_is_ours
    text = str(error).lower()
    return any(marker in text for marker in _TRANSIENT)


class PortInUseError(RuntimeError):
    """The store port is taken; transient only when agang chose the port."""

    def __init__(self, message: str, *, port_is_ours: bool) -> None:
        super().__init__(message)
        self.port_is_ours = port_is_ours


def retrying(policy: RetryPolicy, deadline: float) -> tenacity.Retrying:
    """A tenacity controller for ``policy`` that never passes ``deadline`` (rule 2)."""
    return tenacity.Retrying(
        stop=policy.stop | _StopAtDeadline(deadline),
        wait=policy.wait,
        sleep=policy.sleep,
        retry=tenacity.retry_if_exception(is_transient),
        reraise=True,
    )
