"""What an op is to the engine: what a collective describes, how it starts, and how its
end comes back.

A collective is checked and described (``agang._collective``) as an ``Op``: its name,
the tensors it uses, what its handle finishes with, a ``start`` (which calls a
``start_*`` of the backend) and its fingerprint. The engine numbers it and hands the
backend the ``start`` and an ``OpEnd`` (the ``done`` the backend calls); see ``engine``'s
rules "The end is reported once" and "Ordered, then done". ``OpEnd`` reports to an
``OpOwner`` (the engine), an interface defined here so that this module needs no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from agang._backends.contract import Done
from agang._handle import Handle

#: Starts an op in the backend; the op reports its end through the ``Done`` it is given.
Start = Callable[[Done], None]
#: An op's order-check fingerprint, or what makes it: made only where it is compared,
#: since most gangs never check order and describing tensors costs on every op.
Fingerprint = str | Callable[[], str]
#: The second phase of a two-phase op: given a way to start its backend op, with the
#: function that turns the op's buffers into the handle's value.
SecondPhase = Callable[[Callable[[Start, Callable[[], Any]], None]], None]


#: One collective as checked and described, ready for the engine to issue, in this order:
#:
#: - its name, as its handle and errors show it (``"broadcast"``);
#: - the tensors it uses, named as the caller passed them: busy until it ends;
#: - what its handle finishes with;
#: - its ``start``, which starts it in the backend;
#: - its order-check fingerprint, or None for ops that are not order-checked
#:   (point-to-point ones).
#:
#: A plain tuple rather than a NamedTuple: one is made per call on the issue path. As a
#: NamedTuple it made ``bench/bench_overhead.py``'s awaited broadcast 5-7% dearer than
#: the mixins it replaced (asyncio, uvloop, trio); as a tuple, within 1.5% (the 2-core
#: CPU machine, 2026-11-25).
Op = tuple[str, Sequence[tuple[str, torch.Tensor]], Any, Start, Fingerprint | None]

#: The ops between some ranks of a gang, not all: they take a sequence number but no
#: number among the gang's collectives, which thus stays equal on every rank.
POINT_TO_POINT = frozenset({"send", "recv", "exchange"})


class OpOwner(Protocol):
    """What an op's end reports to (the engine that issued it)."""

    def complete(self, handle: Handle[Any], value: Any, error: BaseException | None) -> None:
        """The op behind ``handle`` ended, with ``error`` or None (its tensors are free)."""

    def ordered(self, handle: Handle[Any], value: Any) -> None:
        """The op behind ``handle`` is ordered on the caller's stream; it has not ended."""

    def ends_inline(self, done: OpEnd) -> bool:
        """Whether ``done`` is being called inside its op's start, on the thread that
        started it (the owner then takes the end itself, once the start returns)."""


def start_guarded(start: Start, done: Done) -> None:
    """Starts an op; an error raised while starting is the op's error."""
    try:
        start(done)
    except Exception as exc:
        done(exc)


class OpEnd:
    """The ``done`` of one op: the backend calls it once the op ended.

    A backend that reports an op once it is ordered on the caller's stream, before it
    ran, calls ``ordered`` first: the handle finishes then and the tensors are free
    for work ordered after it, while the op stays in flight (deadlines, close, abort)
    until the call.
    """

    __slots__ = (
        "_claim",
        "_engine",
        "_handle",
        "_keep",
        "_output",
        "_release",
        "_released",
        "ended_inline",
        "inline_error",
    )

    def __init__(
        self,
        engine: OpOwner,
        handle: Handle[Any],
        output: Any,
        release: Callable[[Any], None],
        claim: Any,
        keep: object = None,
    ) -> None:
        self._engine = engine
        self._handle = handle
        self._output = output
        # ``release(claim)`` frees the op's tensors (``busy``): a function and its
        # argument rather than a partial, one object less per op.
        self._release = release
        self._claim = claim
        # The op's tensors, alive until the claim on their memory is released: a
        # backend may drop its own references before it calls ``done`` (FakeWorld
        # finishes later, on the loop), and memory freed while still claimed could be
        # handed to a new tensor that the stale claim then refuses.
        self._keep = keep
        self._released = False
        #: Ended inside its start on the starting thread, with this error (None: success).
        self.ended_inline = False
        self.inline_error: BaseException | None = None

    @property
    def output(self) -> Any:
        return self._output

    def __call__(self, error: BaseException | None) -> None:
        if not self._released:
            self._released = True
            self._release(self._claim)
            self._keep = None
        engine = self._engine
        if engine.ends_inline(self):
            # Inside its start, on the thread that started it: the engine takes the end
            # from there once the start returns (``Engine._start_now``).
            self.ended_inline = True
            self.inline_error = error
            return
        engine.complete(self._handle, self._output, error)

    def ordered(self) -> None:
        if not self._released:
            self._released = True
            self._release(self._claim)
            self._keep = None
        self._engine.ordered(self._handle, self._output)
