"""Which memory is in use by an unfinished op.

c10d cannot cancel an op, so an op whose waiter was cancelled or timed out still reads
and writes its tensors until it really ends. Handing that memory to another op would
corrupt data silently; agang refuses it instead.

Memory is tracked as address ranges: a view of a busy tensor overlaps it and is busy,
while two disjoint slices of one flat buffer (gradient buckets) may be in flight at
once. Distinct live allocations never share addresses (CPU and CUDA share one virtual
address space), so no storage or device lookup is needed. Busy ranges never overlap
each other (an overlap is refused), so they are kept sorted by start and searched with
bisect. The registry is process-wide: the same tensor passed to two gangs would corrupt
data just as well. Zero-element tensors occupy no bytes and are never busy.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

import torch

from agang._errors import TensorBusyError

Claim = list[tuple[int, int]]  # the (start, end) ranges one op holds

_lock = threading.Lock()
_take, _give = _lock.acquire, _lock.release
_starts: list[int] = []
_ends: list[int] = []
_holders: list[object] = []


def acquire(tensors: Sequence[tuple[str, torch.Tensor]], holder: object) -> Claim:
    """Marks the tensors' memory busy for ``holder``, or raises if any of it already is.

    Args:
        tensors: ``(parameter name, tensor)`` pairs; the name goes into the error.
        holder: The op taking the memory; its ``str`` describes it in errors.

    Returns:
        The claimed ranges, to pass to ``release`` when the op has ended.

    Raises:
        TensorBusyError: Some memory is held by an unfinished op; nothing is marked.
    """
    if len(tensors) == 1:
        return acquire_one(*tensors[0], holder)
    claim: Claim = []
    with _lock:
        for name, tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if not size:
                continue
            start = tensor.data_ptr()
            end = start + size
            index = bisect.bisect_left(_starts, end) - 1
            if index >= 0 and _ends[index] > start:
                _refuse(name, _holders[index])
            claim.append((start, end))
        claim = _union(claim)  # one op may name memory twice (in place; one send to two)
        for start, end in claim:
            index = bisect.bisect_left(_starts, start)
            _starts.insert(index, start)
            _ends.insert(index, end)
            _holders.insert(index, holder)
    return claim


def acquire_one(name: str, tensor: torch.Tensor, holder: object) -> Claim:
    """``acquire`` for one (contiguous) tensor, the common case, without the loops."""
    size = tensor.nbytes
    if not size:
        return []
    start = tensor.data_ptr()
    end = start + size
    _take()  # not ``with``: per op, the explicit calls cost less
    try:
        if _starts:
            index = bisect.bisect_left(_starts, end) - 1
            if index >= 0 and _ends[index] > start:
                _refuse(name, _holders[index])
            index += 1
            _starts.insert(index, start)
            _ends.insert(index, end)
            _holders.insert(index, holder)
        else:  # nothing in flight: the usual case of awaited ops
            _starts.append(start)
            _ends.append(end)
            _holders.append(holder)
    finally:
        _give()
    return [(start, end)]


def _union(ranges: Claim) -> Claim:
    """``ranges`` merged where they overlap: one op's tensors may share memory."""
    merged: Claim = []
    for start, end in sorted(ranges):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def release_all(claims: Sequence[Claim]) -> None:
    """Frees several ops' ranges under one lock (the members of a flat op)."""
    with _lock:
        freed = {start for claim in claims for start, _ in claim}
        if len(freed) < 8:
            for start in freed:
                _remove(start)
            return
        # Many at once: one pass over the registry beats a bisect and a move of the
        # list's tail per range.
        kept = [i for i, start in enumerate(_starts) if start not in freed]
        _starts[:] = [_starts[i] for i in kept]
        _ends[:] = [_ends[i] for i in kept]
        _holders[:] = [_holders[i] for i in kept]


def _remove(start: int) -> None:
    index = bisect.bisect_left(_starts, start)
    if index < len(_starts) and _starts[index] == start:
        del _starts[index], _ends[index], _holders[index]


def release(claim: Claim) -> None:
    """Frees the ranges ``acquire`` returned."""
    if not claim:
        return
    _take()
    try:
        for start, _ in claim:
            if _starts and _starts[-1] == start:  # the highest range (the only one, often)
                del _starts[-1], _ends[-1], _holders[-1]
            else:
                _remove(start)
    finally:
        _give()


def is_busy(tensor: torch.Tensor) -> bool:
    """Whether any of ``tensor``'s memory is held by an unfinished op (nothing is marked)."""
    size = tensor.nbytes
    if not size:
        return False
    start = tensor.data_ptr()
    with _lock:
        index = bisect.bisect_left(_starts, start + size) - 1
        return index >= 0 and _ends[index] > start


def num_busy() -> int:
    """The number of busy ranges in this process (for tests and statistics)."""
    with _lock:
        return len(_starts)


def _refuse(name: str, holder: object) -> None:
    raise TensorBusyError(
        f"`{name}` must not be in use by an unfinished op, but its memory is held by "
        f"{holder}, which c10d has not finished yet (a cancelled or timed-out wait does "
        f"not stop the op). Await that op first, or pass another tensor."
    )
