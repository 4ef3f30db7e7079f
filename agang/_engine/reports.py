"""The errors the engine reports when an op times out or the ranks disagree.

Pure: plain data in, an error out. Each message names the gang, rank, op and seq (the
``OpContext``), says what happened and what it did to the gang.
"""

from __future__ import annotations

from agang._backends import fingerprint as flows
from agang._blame import Progress, verdict
from agang._errors import CollectiveMismatchError, GangTimeoutError, OpContext


def mismatch(
    context: OpContext, index: int, fingerprints: dict[int, str]
) -> CollectiveMismatchError:
    """The ranks issued different collectives at this gang's ``index``-th order check,
    or the same uneven one with split sizes that disagree (``agang._backends.fingerprint``)."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in sorted(fingerprints.items()):
        groups.setdefault(flows.split(fingerprint)[0], []).append(rank)
    if len(groups) == 1:
        (op,) = groups
        pairs = flows.disagreements(fingerprints)
        listed = "; ".join(pairs[: flows.MAX_NAMED]) + (
            "; ..." if len(pairs) > flows.MAX_NAMED else ""
        )
        what = (
            f"the ranks' split sizes disagree at collective #{index} of this gang, {op}: {listed}"
        )
    else:
        sides = "; ".join(f"ranks {ranks} issued {fp}" for fp, ranks in groups.items())
        what = (
            f"the ranks issued different collectives at collective #{index} of this gang: {sides}"
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
) -> GangTimeoutError:
    """An op's deadline passed. ``blamed`` is what the peers said (``agang._blame``);
    ``absent`` the ranks that had not issued the op or did not answer, None where the
    peers could not be asked; ``index`` the op's order check, when it was still in it."""
    consequence = (
        "The gang is now broken."
        if abort
        else "Its tensors stay busy until the op really ends; the gang stays usable."
    )
    if index is not None and absent:
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
        else {rank: verdict(progress) for rank, progress in peers.items()},
    )
