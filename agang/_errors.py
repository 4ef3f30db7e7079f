"""The exceptions agang raises.

Every error that comes from a collective carries where it happened (gang, rank, size,
op, sequence number) so that a log line from any rank can be matched with the others.
c10d's own exception is always kept as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OpContext:
    """Where a collective ran: enough to line up the same op across ranks."""

    gang: str
    rank: int
    size: int
    op: str
    seq: int
    timeout: float | None

    def describe(self) -> str:
        """The op, its number, its gang and rank, and its timeout, in one phrase for messages."""
        timeout = "none" if self.timeout is None else f"{self.timeout:g} s"
        return (
            f"`{self.op}` (seq {self.seq}) on gang '{self.gang}' "
            f"(rank {self.rank} of {self.size}, timeout {timeout})"
        )


class GangError(Exception):
    """Base class of every error agang raises about a gang or a collective."""


class GangInitError(GangError):
    """Setting up a gang (rendezvous or process-group creation) failed.

    Attributes:
        missing_ranks: The ranks that did not check in, where known.
        store_address: ``host:port`` of the rendezvous store, where one was used.
        attempts: How many attempts were made.
        elapsed: Seconds spent before giving up.
    """

    def __init__(
        self,
        message: str,
        *,
        missing_ranks: Sequence[int] = (),
        store_address: str | None = None,
        attempts: int = 1,
        elapsed: float | None = None,
    ) -> None:
        super().__init__(message)
        self.missing_ranks = tuple(missing_ranks)
        self.store_address = store_address
        self.attempts = attempts
        self.elapsed = elapsed


class GangClosedError(GangError):
    """The gang was closed: by [`Gang.close`][agang.Gang.close], or while this op was pending."""


class GangInheritedError(GangError):
    """The gang was made by the parent of this forked process, which alone may use it.

    A child made by ``os.fork()`` inherits the parent's gangs, but their communicator's
    connections belong to the parent: every use in the child (an op, a lane, a sub-gang)
    raises this at once, without touching the communicator. ``close()`` in the child
    only marks the gang closed there. Call [`agang.init`][agang.init] in the child for a gang of
    its own.
    """


class GangBrokenError(GangError):
    """An earlier failure left the gang's communicator unusable.

    Raised at once, with no c10d call, by every op issued after the failure. The first
    failure is attached as ``__cause__`` and as [`first_cause`][agang.GangBrokenError.first_cause].
    """

    def __init__(self, message: str, first_cause: BaseException | None) -> None:
        super().__init__(message)
        self.first_cause = first_cause


class CollectiveError(GangError):
    """A collective failed in c10d (a peer was lost, a connection closed, ...).

    Attributes:
        context: Where the op ran.
    """

    def __init__(self, message: str, context: OpContext) -> None:
        super().__init__(message)
        self.context = context


class GangTimeoutError(CollectiveError, TimeoutError):
    """A collective missed its deadline.

    It is both a [`GangError`][agang.GangError] and the builtin ``TimeoutError``.

    Attributes:
        context: Where the op ran (its ``timeout`` is the deadline that passed).
        elapsed: Seconds from issue to expiry.
        in_flight: One line per op still in flight on this gang when the deadline passed.
        recent: One line per op completed most recently on this gang, oldest first.
        absent_ranks: The ranks that had not issued this op by the deadline (they
            skipped it, or are stalled or late before it) or gave no answer when asked
            (dead, stopped, or cut off); empty when every rank had, or when unknown.
        peers: Each other rank's answer when asked, just after the deadline, where it
            stands on this op: ``"issued it and is waiting for it"``, ``"has not issued
            it (last op issued: ...)"``, ``"has finished it (...)"``, ``"no answer (...)"``
            and the like; empty where the peers could not be asked (the message says why).
    """

    def __init__(
        self,
        message: str,
        context: OpContext,
        *,
        elapsed: float,
        in_flight: Sequence[str] = (),
        recent: Sequence[str] = (),
        absent_ranks: Sequence[int] = (),
        peers: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message, context)
        self.elapsed = elapsed
        self.in_flight = tuple(in_flight)
        self.recent = tuple(recent)
        self.absent_ranks = tuple(absent_ranks)
        self.peers: Mapping[int, str] = dict(peers or {})


class TensorBusyError(GangError, ValueError):
    """A tensor passed to an op is still in use by an earlier op that has not finished.

    This includes ops whose waiter was cancelled or timed out: c10d cannot cancel an op,
    so its tensors stay in use until it really ends.
    """


class GangFullError(GangError):
    """The gang is at its in-flight bound and its policy is to refuse (``when_full="raise"``).

    Nothing was issued: the call can be made again once earlier ops have finished.
    """


class CollectiveMismatchError(CollectiveError):
    """The ranks issued different collectives at the same position (order checking).

    Raised on every rank, before the real op is started, instead of a hang or corrupt data.

    Attributes:
        context: This rank's op.
        fingerprints: Each rank's fingerprint of its op at this position, by rank.
    """

    def __init__(self, message: str, context: OpContext, fingerprints: dict[int, str]) -> None:
        super().__init__(message, context)
        self.fingerprints = dict(fingerprints)


def one_line(error: BaseException, limit: int = 200) -> str:
    """``error``'s message as one short line: its first line, cut at ``limit`` characters
    (c10d's messages can carry a C++ trace after the first line)."""
    if not isinstance(error, BaseException):
        raise TypeError(f"`error` must be an exception, but is {error!r} instead.")
    if limit < 1:
        raise ValueError(f"`limit` must be a positive int, but is {limit!r} instead.")
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
