"""The errors the engine reports when an op fails, times out or the ranks disagree.

Pure: plain data in, an error out. Each message names the gang, rank, op and seq (the
``OpContext``), says what happened and what it did to the gang.

A timeout also says where each peer stands on the late op: the backend's blame
(``start_blame`` in ``agang._backends.contract``) brings every peer's ``Progress``, and
the verdicts below turn them into words, one per peer. Rules of the verdicts:
1. A peer that gives no answer within the backend's bound is said to have given none
   (dead, stopped, or cut off from the store); a rank that could not ask at all says so.
2. Absent ranks are those that had not issued the op, or did not answer: the ones a
   user looks at first. ``check_order``'s census names the same ranks.
3. A peer that issued another op at the same number is not "waiting for it": the
   ranks' ops went out of step (a skipped or extra op on some rank), and the verdict
   names both ops. ``check_order=True`` refuses such a call at issue.
4. A collective is asked about by its number among the gang's collectives, and a peer
   answers with the last one it issued (``Progress.collective``): whether it reached the
   op is judged by that count, not by its sequence number, which point-to-point ops
   among some ranks advance on those ranks only. A peer that ran a ``send`` the asker
   took no part in has not issued the all-reduce the asker is late on, whatever its
   sequence number says. An answer without the count was asked by sequence number.
5. A peer that issued the same op with other arguments (another root, reduce op, dtype
   or shape: what its fingerprint holds, compared where the op is still in flight on
   both ranks) is not "waiting for it" either: the ranks' calls disagree, and the
   verdict names the arguments that differ, the peer's and this rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from agang._backends.contract import Explanation, Progress
from agang._backends.fingerprint import MAX_NAMED, disagreements, split
from agang._errors import (
    CollectiveError,
    CollectiveMismatchError,
    GangBrokenError,
    GangTimeoutError,
    OpContext,
)

#: Every peer's answer (None: no answer in time); the whole is None where the peers
#: could not be asked at all (the store did not answer).
Peers = Mapping[int, Progress | None]


def call_of(fingerprint: str | Callable[[], str] | None) -> str | None:
    """The call of an in-flight op, as its fingerprint's first line, or None where it
    has none (rule 5)."""
    if fingerprint is None:
        return None
    try:
        text = fingerprint if isinstance(fingerprint, str) else fingerprint()
    except Exception:  # asked on a blame's thread: an answer without it is still one
        return None
    return split(text)[0]


def _arguments(call: str) -> list[str]:
    """A call's arguments, as its fingerprint lists them: ``broadcast(source_rank=1,
    float32[4])`` gives ``source_rank=1`` and ``float32[4]``."""
    inside = call.partition("(")[2].rpartition(")")[0]
    parts, depth, start = [], 0, 0
    for i, char in enumerate(inside):
        depth += (char in "[(") - (char in "])")
        if char == "," and depth == 0:
            parts.append(inside[start:i].strip())
            start = i + 1
    return [*parts, inside[start:].strip()]


def argument_difference(theirs: str, mine: str) -> str:
    """Which arguments differ between a peer's call and this rank's, in words (rule 5)."""
    a, b = _arguments(theirs), _arguments(mine)
    pairs = [f"`{x}` where this rank has `{y}`" for x, y in zip(a, b, strict=False) if x != y]
    if len(a) != len(b) or not pairs:
        return f"`{theirs}` where this rank has `{mine}`"
    return ", ".join(pairs)


def disagrees(progress: Progress | None, op: str | None, call: str | None) -> bool:
    """Whether the peer issued the same op as ``op`` with other arguments (rule 5)."""
    return (
        progress is not None
        and call is not None
        and progress.asked_call is not None
        and progress.asked_call != call
        and not differs(progress, op)
    )


def verdict(progress: Progress | None, op: str | None = None, call: str | None = None) -> str:
    """What one peer's answer says about the op it was asked about (rules 1, 3 and 5);
    ``op`` is the asking rank's op at that number, ``call`` its fingerprint's first line."""
    if progress is None:
        return "no answer (dead, stopped, or cut off from the store)"
    counted = progress.collective is not None
    if differs(progress, op):
        number = f"collective #{progress.asked}" if counted else f"#{progress.asked}"
        return f"issued {number} `{progress.asked_op}`, not `{op}`"
    if disagrees(progress, op, call) and progress.asked_call and call:
        what = argument_difference(progress.asked_call, call)
        return f"issued it with other arguments: {what}"
    last = "nothing yet" if progress.issued < 0 else f"#{progress.issued} `{progress.op}`"
    if progress.state == "closed":
        return f"has closed the gang (last op issued: {last})"
    if progress.state == "broken":
        return f"its gang is broken by an earlier failure (last op issued: {last})"
    if progress.waiting:
        return "issued it and is waiting for it"
    if not reached(progress):
        busy = f", {progress.num_in_flight} in flight" if progress.num_in_flight else ""
        # The count of collectives, where point-to-point ops make it differ from the
        # sequence number (rule 4): the number the question was about.
        if progress.collective is not None and progress.collective != progress.issued:
            busy += f"; collectives issued: {progress.collective + 1}"
        return f"has not issued it (last op issued: {last}{busy})"
    return f"has finished it (last op issued: {last})"


def reached(progress: Progress) -> bool:
    """Whether the peer had issued the op it was asked about (rule 4)."""
    issued = progress.issued if progress.collective is None else progress.collective
    return issued >= progress.asked


def differs(progress: Progress | None, op: str | None) -> bool:
    """Whether the peer issued another op than ``op`` at the number asked (rule 3)."""
    return (
        progress is not None
        and op is not None
        and progress.asked_op is not None
        and progress.asked_op != op
    )


def absent(peers: Peers) -> list[int]:
    """The peers that had not issued the op asked about, or did not answer (rule 2)."""
    return sorted(
        rank
        for rank, progress in peers.items()
        if progress is None or (not reached(progress) and progress.state == "open")
    )


def out_of_step(peers: Peers, op: str | None) -> list[int]:
    """The peers that issued another op than ``op`` at the number asked (rule 3)."""
    return sorted(rank for rank, progress in peers.items() if differs(progress, op))


def disagreeing(peers: Peers, op: str | None, call: str | None) -> list[int]:
    """The peers that issued ``op`` with other arguments than ``call`` (rule 5)."""
    return sorted(rank for rank, progress in peers.items() if disagrees(progress, op, call))


def describe(
    peers: Peers, where: Callable[[int], str], op: str | None = None, call: str | None = None
) -> str:
    """One sentence naming every peer with its verdict, for the timeout's message;
    ``op`` is this rank's op at the number asked, ``call`` its fingerprint's first line."""
    if not peers:
        return ""
    parts = [f"{where(rank)}: {verdict(peers[rank], op, call)}" for rank in sorted(peers)]
    return "Peers: " + "; ".join(parts) + "."


def abandoned(what: object, name: str, cause: BaseException) -> GangBrokenError:
    """The error of ``what`` (a pending handle, or a queued op) on gang ``name``, failed
    because the gang broke on ``cause``."""
    error = GangBrokenError(
        f"{what} on gang '{name}' was abandoned: the gang broke on an earlier failure: {cause}",
        cause,
    )
    error.__cause__ = cause
    return error


def failed(context: OpContext, error: BaseException, explained: Explanation) -> CollectiveError:
    """A backend's ``error`` as the op's ``CollectiveError``, with what the backend knows
    behind it (``explained``). Where a peer gave up first, the message leads with that
    (who, on which op, at what deadline, whom it blamed) and leaves the transport's text
    ("Connection closed by peer ...", the effect of that peer's abort) to ``__cause__``;
    Where the transport names a peer that closed its connection without giving up (it
    exited, closed its gang or crashed), the message leads with which rank that is and
    then quotes the transport; otherwise the transport's text is all there is."""
    if explained.reported:
        message = (
            f"{context.describe()} failed: {explained.reported}. The transport's error: {error}"
        )
    elif explained.gave_up:
        message = (
            f"{context.describe()} failed because {explained.gave_up}. Its abort closed the "
            f"connections this op ran on (the transport's error is this error's `__cause__`)."
        )
    elif explained.lost:
        message = (
            f"{context.describe()} failed: its connection to a peer was lost.{explained.lost} "
            f"It did not give up on this op at a deadline: it exited, closed its gang or "
            f"crashed (its own output says which). The transport's error: {error}"
        )
    else:
        message = f"{context.describe()} failed: {error}"
    wrapped = CollectiveError(message, context)
    wrapped.__cause__ = error
    return wrapped


def mismatch(
    context: OpContext, index: int, fingerprints: dict[int, str]
) -> CollectiveMismatchError:
    """The ranks issued different collectives at this gang's ``index``-th order check,
    or the same uneven one with split sizes that disagree (``agang._backends.fingerprint``)."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in sorted(fingerprints.items()):
        groups.setdefault(split(fingerprint)[0], []).append(rank)
    if len(groups) == 1:
        (op,) = groups
        pairs = disagreements(fingerprints)
        listed = "; ".join(pairs[:MAX_NAMED]) + ("; ..." if len(pairs) > MAX_NAMED else "")
        what = (
            f"the ranks' split sizes disagree at collective #{index} of this gang, {op}: {listed}"
        )
    else:
        sides = "; ".join(f"ranks {ranks} issued {fp}" for fp, ranks in groups.items())
        names = {call.partition("(")[0] for call in groups}
        calls = list(groups)
        both = zip(_arguments(calls[0]), _arguments(calls[-1]), strict=False)
        differing = ", ".join(f"`{a}` against `{b}`" for a, b in both if a != b)
        if len(names) == 1 and len(groups) == 2 and differing:  # one op, other arguments
            what = (
                f"the ranks called `{names.pop()}` with different arguments ({differing}) at "
                f"collective #{index} of this gang: {sides}"
            )
        else:
            what = (
                f"the ranks issued different collectives at collective #{index} of this "
                f"gang: {sides}"
            )
    return CollectiveMismatchError(
        f"{context.describe()}: {what}. Nothing was started; the gang is now broken.",
        context,
        fingerprints,
    )


def timed_out(
    context: OpContext,
    *,
    elapsed: float,
    in_flight: list[str],
    recent: list[str],
    abort: bool,
    index: int | None,
    absent: list[int] | None,
    blamed: str,
    peers: dict[int, Progress | None] | None,
    out_of_step: list[int] | None = None,
    asked_op: str | None = None,
    disagree: list[int] | None = None,
    asked_call: str | None = None,
) -> GangTimeoutError:
    """An op's deadline passed. ``blamed`` is what the peers said (``describe``);
    ``absent`` the ranks that had not issued the op or did not answer, None where the
    peers could not be asked; ``index`` the op's order check, when it was still in it;
    ``asked_op`` this rank's op at the number asked, so that ``peers`` names a peer out
    of step as the message does."""
    consequence = (
        "The gang is now broken."
        if abort
        else "Its tensors stay busy until the op really ends; the gang stays usable."
    )
    if out_of_step:
        why = (
            f"ranks {out_of_step} issued another op at this position: the ranks' ops are "
            f"out of step (one skipped an op, or issued one more), so no op can pair up; "
            f"`check_order=True` refuses such a call at issue, naming both ops."
        )
    elif disagree:
        why = (
            f"ranks {disagree} issued this op with other arguments (root, reduce op, dtype "
            f"or shape; named below): the ranks' calls disagree, so it cannot complete; "
            f"`check_order=True` refuses such a call at issue, on every rank."
        )
    elif index is not None and absent:
        why = (
            f"ranks {absent} had not issued collective #{index} of this gang (order "
            f"checking got no fingerprint of theirs): they skipped it, or are stalled "
            f"or late before it."
        )
    elif index is not None and absent is None:
        why = (
            f"order checking got no fingerprint from some rank for collective #{index}: "
            f"a peer may be late, stopped, or issuing its ops in another order."
        )
    else:
        why = "a peer may be late, stopped, or issuing its ops in another order."
    return GangTimeoutError(
        f"{context.describe()} timed out after {elapsed:.3f} s; {why} {consequence} {blamed}",
        context,
        elapsed=elapsed,
        in_flight=in_flight,
        recent=recent,
        absent_ranks=absent or [],
        peers={}
        if peers is None
        else {rank: verdict(progress, asked_op, asked_call) for rank, progress in peers.items()},
    )
