"""What an op is to the engine: how it starts, and how its end comes back.

The engine hands the backend a ``start`` (which calls a ``start_*`` of the backend) and
an ``OpEnd`` (the ``done`` the backend calls); see ``engine``'s rules "The end is
reported once" and "Ordered, then done".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agang._backends.contract import Done

if TYPE_CHECKING:
    from agang._engine.engine import Engine
    from agang._handle import Handle

#: Starts an op in the backend; the op reports its end through the ``Done`` it is given.
Start = Callable[[Done], None]
#: The second phase of a two-phase op: given a way to start its backend op, with the
#: function that turns the op's buffers into the handle's value.
#: An op's order-check fingerprint, or what makes it: made only where it is compared,
#: since most gangs never check order and describing tensors costs on every op.
Fingerprint = str | Callable[[], str]
SecondPhase = Callable[[Callable[[Start, Callable[[], Any]], None]], None]


def start_guarded(start: Start, done: Done) -> None:
    """Starts an op; an error raised while starting is the op's error."""
    try:
        start(done)
    except Exception as exc:
        done(exc)


class OpEnd:
    """The ``done`` of one op: the backend calls it once the op ended.

    A backend that reports an op once it is ordered on the caller's stream, before it
    ran, calls :meth:`ordered` first: the handle finishes then and the tensors are free
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
        engine: Engine,
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
