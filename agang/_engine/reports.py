"""The errors the engine reports when an op times out or the ranks disagree.

Pure: plain data in, an error out. Each message names the gang, rank, op and seq (the
``OpContext``), says what happened and what it did to the gang.
"""

from __future__ import annotations

from agang._errors import CollectiveMismatchError, GangTimeoutError, OpContext


def mismatch(
    context: OpContext, index: int, fingerprints: dict[int, str]
) -> CollectiveMismatchError:
    """The ranks issued different collectives at this gang's ``index``-th order check."""
    groups: dict[str, list[int]] = {}
    for rank, fingerprint in sorted(fingerprints.items()):
        groups.setdefault(fingerprint, []).append(rank)
    sides = "; ".join(f"ranks {ranks} issued {fp}" for fp, ranks in groups.items())
    return CollectiveMismatchError(
        f"{context.describe()}: the ranks issued different collectives at collective "
        f"#{index} of this gang: {sides}. Nothing was started; the gang is now broken.",
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
) -> GangTimeoutError:
    """An op's deadline passed; ``absent`` are the ranks a census found had not reached
    its order check (``index``), if any; None where a census could not tell."""
    consequence = (
        "The gang is now broken."
        if abort
        else "Its tensors stay busy until the op really ends; the gang stays usable."
    )
    if absent:
        why = (
            f"ranks {absent} had not issued collective #{index} of this gang (order "
            f"checking got no fingerprint of theirs): they skipped it, or are stalled "
            f"or late before it."
        )
    elif index is not None and absent is None:
        why = (
            f"order checking got no fingerprint from some rank for collective #{index}, "
            f"and the store could not be asked which (its host may be stopped or "
            f"unreachable): a peer may be late, stopped, or issuing its ops in another order."
        )
    else:
        why = "a peer may be late, stopped, or issuing its ops in another order."
    return GangTimeoutError(
        f"{context.describe()} timed out after {elapsed:.3f} s; {why} {consequence}",
        context,
        elapsed=elapsed,
        in_flight=in_flight,
        recent=recent,
        absent_ranks=absent or [],
    )
