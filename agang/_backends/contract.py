"""The backend contract: everything a gang needs from a communicator, in one place.

A gang (``agang._collective.gang.CollectiveGang``) validates the user's call, and its
engine (``agang._engine.engine``) numbers the op, admits it under the in-flight bounds,
arms its deadline and hands it to the backend with one of the ``start_*`` methods below.
The backend only moves bytes and reports the end. c10d (``c10d.backend.C10dBackend``:
Gloo and NCCL), the in-process ``fake.FakeBackend`` and the simulated world of
``agang.testing._world.backend.FakeWorldBackend`` implement it; a new transport (a
simulated NCCL, a subprocess-isolated group, torch's newer communicators) implements it
too, and nothing else in agang changes.

What a backend promises:

Starting.
    Each ``start_*`` starts its op and calls ``done(error)`` exactly once, from any
    thread, when the backend has finished with the op's tensors: ``done(None)`` on
    success, ``done(exc)`` on failure (a raw exception: the engine wraps it). Until
    then the tensors are the backend's; after it, never again. A ``start_*`` that
    raises has started nothing, and the engine reports its error as the op's. The
    engine calls ``start_*`` in the op's sequence order, one at a time per gang, never
    on two threads at once, possibly later than the user's call and on another thread
    (see ``defer``).
Ordered before done.
    A backend that reports ops once they are ordered on the caller's stream, before
    they ran (NCCL's stream-ordered mode), calls ``report_ordered(done)`` then, and
    still calls ``done(error)`` once the op really ended: the handle finishes at the
    first, while the op stays in flight (deadlines, close, abort) until the second.
Learning of an end.
    A backend either calls ``done`` from a thread of its own as soon as the op ended
    (``polls`` False: Gloo's callbacks, the fakes), or learns of an end only when asked
    (``polls`` True: NCCL, whose ops end on a device that no host thread watches for
    free). Then ``poll()`` calls, on the calling thread and without blocking, the
    ``done`` of every op it finds ended, and ``park(issued_before)`` hands the ops not
    yet reported that were issued before then to a thread of the backend's own, which
    waits for each (sleeping, not spinning) and calls its ``done``; it returns when the
    oldest op left was issued (``time.monotonic()``), or None. The engine polls at each
    issue and while a task awaits an op, and parks what is still running when that
    task's budget has passed, when a plain thread waits, and when the gang's timer finds
    an op running longer than the park delay; so every op's ``done`` comes, awaited or
    not, and an awaited op that ends soon needs no thread at all.
Read on the host.
    ``to_host=True`` (the object collectives, whose bytes agang reads on the CPU) asks
    for ``done`` only once the result can be read on the host, even where the backend
    otherwise reports an op done earlier (NCCL's stream-ordered mode: done once ordered
    on the caller's stream, before the device ran it).
Post-processing.
    ``start_all_reduce``'s ``post``, when given, runs after the reduction and before
    ``done(None)``: on CUDA in stream order, after the reduction's kernels. Its error
    becomes the op's error. Coalescing uses it to copy a flat result back into its
    members.
Not blocking.
    No method may wait for a peer on the caller's thread, except ``release`` (run off
    the event loop) and ``create_child`` (a coroutine, whose waiting is the backend's
    to take off the loop).
Order checks.
    ``start_order_check(index, fingerprint, checked)`` compares this rank's
    ``index``-th fingerprint with every rank's, on a channel the gang's ops never queue
    behind, and calls ``checked(None, None)`` when all agree, ``checked(fingerprints,
    None)`` (every rank's) when they differ, ``checked(None, error)`` when the check
    itself failed.
Blame.
    The engine tells the backend once, with ``serve_progress(progress)``, how to say
    where this rank stands on the gang (a ``Progress``, below, of the op a peer asks
    about); until a peer asks, this costs nothing. A peer is asked about a collective
    by its number among the gang's collectives (every op but ``send``, ``recv`` and
    ``exchange``), which is the same on every rank: the ranks issue the same collectives
    in the same order, while point-to-point ops among some ranks advance only those
    ranks' sequence numbers. A point-to-point op is asked about by its sequence number.
    ``start_blame(number, report, collective=...)`` asks every other rank about the op
    of that number (once its deadline passed here) and calls
    ``report(peers, note)`` once, within ``BLAME_BOUND`` seconds whatever the peers or
    the channel do: ``peers`` maps each other rank to its answer, None for one that gave
    none; ``peers`` is None where nobody could be asked, and ``note`` says why.
    ``where(rank)`` names a rank for messages: where it runs, as far as the backend knows;
    ``explain(error)`` says what lies behind a transport's error, where it can: the
    peers that gave up first at their deadline (whose abort dropped the connection), and
    the lost peer the error's address names.
Deadlines.
    agang's deadlines are the engine's. A backend with a deadline of its own (c10d's
    process-group timeout) keeps it behind agang's: ``allow_timeout(seconds)`` says
    an op may now run that long (None: no agang deadline, so the backend's own must
    not fire at all), and the backend moves its own timeout past it, so it never fails
    an op before agang would.
Failure and lifecycle.
    ``abort()`` ends the running work after a failure, so its ``done`` calls come soon,
    and never blocks (it may start a thread). ``release(unfinished=...)`` frees the
    communicator when the gang closes; it runs off the loop and may block briefly;
    ``unfinished`` says work may still be running (the gang broke, or closed with ops
    in flight), which must then be ended first. After either, the backend gives up
    any wait of its own (order checks, a blame) and starts nothing new; it stops
    answering peers' blames once released.
Children.
    ``create_child(members, ...)`` is a collective call on this backend's ranks that
    makes a backend over ``members`` (ranks of this one, sorted): sub-gangs, and lanes
    (every rank a member, an order of their own). It returns the child on members and
    None on the others, and fails with ``GangInitError`` when it cannot finish within
    ``seconds``. It is not an op: it takes no sequence number.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

import torch

from agang._backends.cuda.runtime import StreamOrder
from agang._reduce_op import ReduceOp

#: A gang's state, as a peer's answer to a blame gives it.
State = Literal["open", "broken", "closed"]


@dataclass(frozen=True)
class Explanation:
    """What a backend knows behind a transport's error (``Backend.explain``)."""

    #: The peers that gave up first, each with its own timeout's message, as one
    #: sentence ("rank 0 (...) gave up first: ..."), or "": the true story, which an
    #: error then leads with.
    gave_up: str = ""
    #: Which rank the error's peer address is (" The peer at ... is rank 1 (...)."), or "".
    lost: str = ""
    #: What a watcher reported of a lost peer (a death notice: "rank 2 (...) was
    #: reported dead by ...: why"), or "": the true story where the transport only saw
    #: a connection drop.
    reported: str = ""


@dataclass(frozen=True)
class Progress:
    """Where one rank stands on one gang, asked about the op numbered ``asked``: what a
    backend's blame carries from a peer (see "Blame")."""

    asked: int
    #: The last sequence number this rank issued on the gang (-1: none yet).
    issued: int
    #: That op's name (None before any).
    op: str | None
    #: The asked-about op is issued here and has not finished.
    waiting: bool
    #: How many of this rank's ops are issued and not finished.
    num_in_flight: int
    state: State
    #: The op this rank issued at ``asked`` (None: not issued, or too long ago to know):
    #: blame compares it with the asker's, for ranks whose ops went out of step.
    asked_op: str | None = None
    #: That op's call as its fingerprint's first line (op and every argument the ranks
    #: must agree on: shapes, dtypes, reduce op, root), where it is still in flight here:
    #: blame compares it with the asker's, for ranks whose calls disagree.
    asked_call: str | None = None
    #: Asked by collective number (``asked`` counts collectives only): the number of the
    #: last collective this rank issued (-1: none), which says whether it reached the
    #: one asked about. None: asked by sequence number, as an older rank's answer is.
    collective: int | None = None

    def to_text(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> Progress:
        fields = json.loads(text)
        return cls(
            asked=int(fields["asked"]),
            issued=int(fields["issued"]),
            op=None if fields["op"] is None else str(fields["op"]),
            waiting=bool(fields["waiting"]),
            num_in_flight=int(fields["num_in_flight"]),
            state=fields["state"] if fields["state"] in ("open", "broken", "closed") else "open",
            asked_op=None if fields.get("asked_op") is None else str(fields["asked_op"]),
            asked_call=None if fields.get("asked_call") is None else str(fields["asked_call"]),
            collective=None if fields.get("collective") is None else int(fields["collective"]),
        )


#: How a backend reports the end of an op: None on success, else the error.
Done = Callable[[BaseException | None], None]
#: How an order check reports: None when every rank agreed, else every rank's
#: fingerprint; or the error of the check itself.
Checked = Callable[[dict[int, str] | None, BaseException | None], None]
#: How a blame reports: every other rank's answer (None: it gave none in time), or None
#: where nobody could be asked; then a note saying why (empty otherwise).
Blamed = Callable[[Mapping[int, Progress | None] | None, str], None]
#: How a rank says where it stands on the gang, asked about one op's number: its
#: sequence number, or (the flag True) its number among the gang's collectives.
ProgressOf = Callable[[int, bool], Progress]

#: The most a blame may take, from the call to its report (seconds).
BLAME_BOUND = 0.5


class Backend(Protocol):
    """A communicator over ``size`` ranks, of which this process is ``rank``."""

    @property
    def rank(self) -> int:
        """This process's rank among the backend's ranks."""

    @property
    def size(self) -> int:
        """The number of ranks."""

    @property
    def device(self) -> torch.device:
        """Where the ops' tensors live."""

    @property
    def kind(self) -> str:
        """``"gloo"``, ``"nccl"`` or ``"fake"``: what ``Gang.backend`` reports."""

    @property
    def name(self) -> str:
        """The gang's name, for threads, logs and keys."""

    # Collectives. The engine has validated the arguments.

    def start_all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        done: Done,
        post: Callable[[], None] | None = None,
    ) -> None:
        """Reduces ``tensor`` in place across ranks; runs ``post`` before ``done``."""

    def start_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, done: Done, *, to_host: bool = False
    ) -> None:
        """``output`` is flat: ``size`` runs shaped like ``input``, in rank order."""

    def start_all_gather_to_list(
        self, outputs: list[torch.Tensor], input: torch.Tensor, done: Done
    ) -> None:
        """``outputs[r]`` receives rank r's ``input``."""

    def start_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, done: Done
    ) -> None:
        """``input`` is flat: ``size`` runs shaped like ``output``; it stays unchanged."""

    def start_broadcast(
        self, tensor: torch.Tensor, source_rank: int, done: Done, *, to_host: bool = False
    ) -> None:
        """Copies ``source_rank``'s ``tensor`` into ``tensor`` on every rank."""

    def start_all_gather_uneven(
        self, output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], done: Done
    ) -> None:
        """``output`` is every rank's ``input`` concatenated along dim 0; rank r's has
        ``split_sizes[r]`` rows (equal lists on every rank)."""

    def start_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        done: Done,
        *,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """Block j of ``input`` goes to rank j; block j of ``output`` comes from rank j.

        Blocks are runs of rows along dim 0: equal without split sizes; with them (both
        given, or neither), ``input_split_sizes[j]`` rows go to rank j and
        ``output_split_sizes[j]`` come from it."""

    def start_reduce(
        self, tensor: torch.Tensor, destination_rank: int, op: ReduceOp, done: Done
    ) -> None:
        """Reduces ``tensor`` into ``destination_rank``'s, divided there for MEAN; the
        other ranks' ``tensor`` may be left holding anything."""

    def start_gather(
        self,
        outputs: list[torch.Tensor] | None,
        input: torch.Tensor,
        destination_rank: int,
        done: Done,
    ) -> None:
        """``outputs[r]`` of ``destination_rank`` receives rank r's ``input``;
        ``outputs`` is None on the other ranks."""

    def start_scatter(
        self,
        output: torch.Tensor,
        inputs: list[torch.Tensor] | None,
        source_rank: int,
        done: Done,
    ) -> None:
        """``output`` of rank r receives ``inputs[r]`` of ``source_rank``; ``inputs`` is
        None on the other ranks and stays unchanged on the source."""

    def start_send(self, tensor: torch.Tensor, destination_rank: int, done: Done) -> None:
        """Sends ``tensor``; matched with ``destination_rank``'s receives in order."""

    def start_recv(self, tensor: torch.Tensor, source_rank: int, done: Done) -> None:
        """Receives into ``tensor``; matched with ``source_rank``'s sends in order."""

    def start_exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        done: Done,
    ) -> None:
        """Every ``(tensor, destination_rank)`` send and ``(tensor, source_rank)``
        receive, as one batch; ``done`` once all have ended. Matched per pair of ranks
        and direction in order, with ``start_send`` and ``start_recv`` too."""

    def start_barrier(self, done: Done) -> None:
        """Finishes once every rank has started its barrier."""

    # Order checking.

    def start_order_check(self, index: int, fingerprint: str, checked: Checked) -> None:
        """Compares the ``index``-th fingerprint across ranks (see the module's rules)."""

    # Blame.

    def serve_progress(self, progress: ProgressOf) -> None:
        """Lets the peers' blames ask this rank where it stands (called once)."""

    def start_blame(self, number: int, report: Blamed, *, collective: bool = False) -> None:
        """Asks every other rank where it stands on op ``number``: a sequence number, or
        with ``collective`` a number among collectives (see the module's rules)."""

    def where(self, rank: int) -> str:
        """``rank`` named for a message, with where it runs when known."""

    def explain(self, error: BaseException) -> Explanation:
        """What lies behind ``error``: the peers that gave up first, and the lost peer's
        rank, where the transport's error lets it be known."""

    # Learning of an end.

    #: Whether ops' ends are learned only when asked (``poll``, ``park``).
    polls: bool

    def poll(self) -> None:
        """Calls, here and now, the ``done`` of every op found ended; never blocks."""

    def park(self, issued_before: float = math.inf) -> float | None:
        """Hands the unreported ops issued before ``issued_before`` to a waiting thread;
        when the oldest op left was issued, or None."""

    # Deferred starts and deadlines.

    def defer(self, start: Callable[[], None]) -> Callable[[], None]:
        """Wraps a start that may run later, on another thread, as if run now (CUDA:
        on the caller's current stream)."""

    def stream_order(self) -> StreamOrder | None:
        """How code above the gang orders its own device work around the gang's ops on
        its streams (a GPU, or a simulated one); None where ops need no stream order."""

    def allow_timeout(self, seconds: float | None) -> None:
        """An op may now run ``seconds`` (None: no agang deadline); keep the backend's
        own timeout behind it."""

    # Failure and lifecycle.

    def abort(self, reason: str | None = None) -> None:
        """Ends running work after a failure; never blocks. ``reason``: why this rank
        gave up (its deadline's message), told to the peers whose ops then fail."""

    def release(self, *, unfinished: bool) -> None:
        """Frees the communicator; off the loop, may block briefly."""

    async def create_child(
        self, members: list[int], *, name: str, high_priority: bool, seconds: float | None
    ) -> Backend | None:
        """A backend over ``members`` (a collective call); None on non-members."""


def after_post(post: Callable[[], None] | None, done: Done) -> Done:
    """``done``, preceded on success by ``post``; an error ``post`` raises is the op's.

    For backends whose transport has no stream order of its own (Gloo, the fakes).
    """
    if post is None:
        return done

    def post_then_done(error: BaseException | None) -> None:
        if error is None:
            try:
                post()
            except Exception as exc:
                error = exc
        done(error)

    return post_then_done


def countdown(count: int, done: Done) -> Done:
    """A ``done`` to call ``count`` times (from any threads) that calls ``done`` once,
    after the last call, with the first error reported, if any."""
    lock = threading.Lock()
    left = count
    first: list[BaseException] = []

    def one_done(error: BaseException | None) -> None:
        nonlocal left
        with lock:
            if error is not None and not first:
                first.append(error)
            left -= 1
            last = left == 0
        if last:
            done(first[0] if first else None)

    return one_done


def holding(done: Done, *held: object) -> Done:
    """``done``, keeping ``held`` (tensors the backend made for the op: a token, a copy
    of the input) alive until it runs, as c10d needs its tensors until the op ends."""

    def done_holding(error: BaseException | None, _held: tuple[object, ...] = held) -> None:
        done(error)

    return done_holding


def report_ordered(done: Done) -> bool:
    """Tells the engine an op is ordered on the caller's stream, before it ran (see
    "Ordered before done"); False if ``done`` cannot take it (then report ``done``)."""
    ordered = getattr(done, "ordered", None)
    if ordered is None:
        return False
    ordered()
    return True
