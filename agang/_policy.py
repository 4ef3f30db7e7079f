"""The per-gang policies users choose: in-flight bounds, timeout handling, order checks.

A gang's policy is fixed when it is made and inherited by its sub-gangs and lanes, so
every ordering domain of one program behaves alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from agang._validate import check_deadline, check_positive_int

WhenFull = Literal["queue", "raise", "block"]
OnTimeout = Literal["abort", "raise"]
#: Order checking: off, on, or on with each op's call site in its fingerprint.
CheckOrder = bool | Literal["call_site"]
#: How an ``await`` of a pending op waits: parked until the completion wakes the loop,
#: or first blocking the loop's thread briefly for a small op (``agang._runtime.brief_wait``).
WaitMode = Literal["park", "block_briefly"]

_WHEN_FULL = ("queue", "raise", "block")
_ON_TIMEOUT = ("abort", "raise")
_WAIT_MODES = ("park", "block_briefly")

#: The deadline of an op called without one, where its gang is made with
#: ``op_timeout=None`` (the default): seconds from the op's issue.
DEFAULT_OP_TIMEOUT = 300.0

#: Environment variable that turns order checking on or off for every gang (``1``/``0``,
#: or ``call_site``).
CHECK_ORDER_ENV = "AGANG_CHECK_ORDER"
#: The backends whose gangs check order by default (``check_order=None`` and
#: ``AGANG_CHECK_ORDER`` unset): on Gloo, a rank that receives more bytes than it expects
#: (a shape, count or dtype that differs between ranks, in every collective) is killed
#: by Gloo (SIGABRT), so a mismatch must be found before the op starts. NCCL's mismatch
#: hangs or garbles instead, which the deadline and its blame report.
CHECKS_ORDER_BY_DEFAULT = frozenset({"gloo"})
#: Environment variable that sets every gang's ``wait_mode`` (``park`` or
#: ``block_briefly``); docs/performance.md ("block_briefly") says when the latter pays.
WAIT_MODE_ENV = "AGANG_WAIT_MODE"


@dataclass(frozen=True)
class InFlightLimits:
    """How much a gang keeps in flight in the backend, and what happens past that.

    Args:
        max_ops: Ops started in the backend at once, at most.
        max_bytes: Bytes of started ops at once, at most; one op larger than this
            still runs, alone.
        when_full: What a call does when the gang is at a bound. ``"queue"`` (default): the call
            returns its handle at once, numbered in call order, and the op starts when room frees;
            ``await``-ing the handle waits for both. ``"raise"``: the call raises
            [`agang.GangFullError`][agang.GangFullError] and issues nothing. ``"block"``: the
            calling thread blocks until there is room (never allowed on an event loop's thread,
            which it would stop).

    Example:
        <!-- not-run: agang.init joins the world a launcher (torchrun) set up -->
        ```python
        gang = await agang.init(limits=agang.InFlightLimits(max_ops=64))
        ```
    """

    max_ops: int = 1024
    max_bytes: int = 1 << 30
    when_full: WhenFull = "queue"

    def __post_init__(self) -> None:
        check_positive_int(self.max_ops, name="max_ops")
        check_positive_int(self.max_bytes, name="max_bytes")
        if self.when_full not in _WHEN_FULL:
            raise ValueError(
                f"`when_full` must be one of {', '.join(map(repr, _WHEN_FULL))}, "
                f"but is {self.when_full!r} instead."
            )


@dataclass(frozen=True)
class GangPolicy:
    """Everything a gang decides per op, bundled so sub-gangs and lanes inherit it."""

    op_timeout: float | None = None
    on_timeout: OnTimeout = "abort"
    limits: InFlightLimits = InFlightLimits()
    check_order: CheckOrder = False
    wait_mode: WaitMode = "park"


def order_check_defaulted(check_order: object, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``check_order`` is left to the backend's default: None, with
    ``AGANG_CHECK_ORDER`` unset (or empty) in ``env`` (default ``os.environ``)."""
    return (
        check_order is None
        and not (os.environ if env is None else env).get(CHECK_ORDER_ENV, "").strip()
    )


def make_policy(
    *,
    op_timeout: object,
    on_timeout: object = "abort",
    limits: object = None,
    check_order: object = None,
    wait_mode: object = None,
    env: dict[str, str] | None = None,
) -> GangPolicy:
    """Checks the user's choices (naming the parameter) and bundles them.

    ``check_order=None`` reads ``AGANG_CHECK_ORDER``, ``wait_mode=None`` reads
    ``AGANG_WAIT_MODE``, from ``env`` (default ``os.environ``).
    """
    timeout = check_deadline(op_timeout, name="op_timeout", default=DEFAULT_OP_TIMEOUT)
    if on_timeout not in _ON_TIMEOUT:
        raise ValueError(
            f"`on_timeout` must be one of {', '.join(map(repr, _ON_TIMEOUT))}, "
            f"but is {on_timeout!r} instead."
        )
    if limits is None:
        limits = InFlightLimits()
    if not isinstance(limits, InFlightLimits):
        raise TypeError(
            f"`limits` must be an `agang.InFlightLimits` or None, "
            f"but is of type `{type(limits).__name__}` instead."
        )
    if check_order is None:
        value = (os.environ if env is None else env).get(CHECK_ORDER_ENV, "0").strip()
        if value not in ("", "0", "1", "call_site"):
            raise ValueError(
                f"`{CHECK_ORDER_ENV}` must be 0, 1 or call_site, but is {value!r} instead."
            )
        check_order = "call_site" if value == "call_site" else value == "1"
    if not isinstance(check_order, bool) and check_order != "call_site":
        raise TypeError(
            f"`check_order` must be a bool, 'call_site' or None, but is {check_order!r} "
            f"of type `{type(check_order).__name__}` instead."
        )
    if wait_mode is None:
        wait_mode = (os.environ if env is None else env).get(WAIT_MODE_ENV, "").strip() or "park"
        name = f"`{WAIT_MODE_ENV}`"
    else:
        name = "`wait_mode`"
    if wait_mode not in _WAIT_MODES:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, _WAIT_MODES))}, "
            f"but is {wait_mode!r} instead."
        )
    return GangPolicy(
        op_timeout=timeout,
        on_timeout=on_timeout,  # type: ignore[arg-type]  # checked above
        limits=limits,
        check_order=check_order,
        wait_mode=wait_mode,  # type: ignore[arg-type]  # checked above
    )
