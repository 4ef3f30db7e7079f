"""Checks of user input, raised before anything is issued.

Every message follows one template: the parameter in backticks, what was expected, and
what was given ("`timeout` must be a non-negative number of seconds or None, but is -1
instead."). These are the scalar checks used everywhere (timeouts, ints, ranks, reduce
ops); the checks of a collective's tensors are ``agang._collective.checks``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agang._reduce_op import ReduceOp


def check_timeout(timeout: object, *, name: str = "timeout") -> float | None:
    """Returns ``timeout`` as float seconds, or None for no deadline."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"`{name}` must be a number of seconds or None, "
            f"but is of type `{type(timeout).__name__}` instead."
        )
    value = float(timeout)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"`{name}` must be a non-negative number of seconds or None, but is {timeout} instead."
        )
    return value


def check_deadline(value: object, *, name: str, default: float | None) -> float | None:
    """A setting's deadline in seconds, in agang's one meaning of a timeout argument:
    None is the setting's ``default``, ``math.inf`` is no deadline (returned as None),
    and a number is seconds."""
    if value is None:
        return default
    seconds = check_timeout(value, name=name)
    return None if seconds is None or math.isinf(seconds) else seconds


def check_positive_int(value: object, *, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, but is {value!r} instead.")
    return value


def check_non_negative_int(value: object, *, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"`{name}` must be an int, but is of type `{type(value).__name__}` instead."
        )
    if value < 0:
        raise ValueError(f"`{name}` must be 0 or more, but is {value} instead.")
    return value


def check_bool(value: object, *, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be a bool, but is of type `{type(value).__name__}` instead."
        )
    return value


def check_rank(rank: object, size: int, *, name: str, self_rank: int | None = None) -> int:
    """Checks that ``rank`` is a rank of a gang of ``size`` (and, if given, not ``self_rank``)."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"`{name}` must be an int, but is of type `{type(rank).__name__}` instead.")
    if not 0 <= rank < size:
        raise ValueError(
            f"`{name}` must be greater than or equal to 0 and less than the size of the gang "
            f"({size}), but is {rank} instead."
        )
    if self_rank is not None and rank == self_rank:
        raise ValueError(f"`{name}` must be another rank than this one ({self_rank}), but is not.")
    return rank


def check_reduce_op(op: object, *, name: str = "op") -> ReduceOp:
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"`{name}` must be an `agang.ReduceOp`, but is of type `{type(op).__name__}` instead."
        )
    return op


def check_member_ranks(ranks: object, size: int) -> list[int]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence):
        raise TypeError(
            f"`ranks` must be a sequence of ints, but is of type `{type(ranks).__name__}` instead."
        )
    members = []
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(
                f"`ranks` must contain ints only, but contains {rank!r} of type "
                f"`{type(rank).__name__}` instead."
            )
        if not 0 <= rank < size:
            raise ValueError(
                f"`ranks` must contain ranks from 0 to {size - 1}, but contains {rank} instead."
            )
        members.append(rank)
    if not members:
        raise ValueError("`ranks` must contain at least one rank, but is empty instead.")
    if len(set(members)) != len(members):
        raise ValueError(f"`ranks` must not repeat a rank, but is {list(ranks)} instead.")
    return sorted(members)
