"""Which tensor memory is in use by an unfinished op.

c10d cannot cancel an op, so an op whose waiter was cancelled or timed out still reads
and writes its tensors until it really ends. Handing such memory to another op would
corrupt data silently; agang refuses it instead.

Memory is tracked as byte ranges of a storage, so a view of a busy tensor is busy, while
two disjoint slices of one flat buffer (gradient buckets) may be in flight at once. The
registry is process-wide: the same tensor passed to two gangs would corrupt data just as
well. Zero-element tensors occupy no bytes and are never busy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from agang._errors import TensorBusyError

_Range = tuple[int, int, str]  # start, end, the op holding it ("all_reduce (seq 3)")

_lock = threading.Lock()
_ranges: dict[tuple[str, int], list[_Range]] = {}


def _key_and_range(tensor: torch.Tensor) -> tuple[tuple[str, int], int, int]:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return (str(tensor.device), tensor.untyped_storage().data_ptr()), start, end


def acquire(tensors: Sequence[tuple[str, torch.Tensor]], holder: str) -> list[torch.Tensor]:
    """Marks the tensors' memory busy for ``holder``, or raises if any of it already is.

    Args:
        tensors: ``(parameter name, tensor)`` pairs; the name goes into the error.
        holder: Describes the op taking the memory.

    Returns:
        The tensors that were marked, to pass to :func:`release` later.

    Raises:
        TensorBusyError: Some memory is held by an unfinished op; nothing is marked.
    """
    entries = []
    for name, tensor in tensors:
        if tensor.numel() == 0:
            continue
        key, start, end = _key_and_range(tensor)
        entries.append((name, key, start, end))
    with _lock:
        for name, key, start, end in entries:
            for busy_start, busy_end, busy_holder in _ranges.get(key, ()):
                if start < busy_end and busy_start < end:
                    raise TensorBusyError(
                        f"`{name}` must not be in use by an unfinished op, but its memory is "
                        f"held by {busy_holder}, which c10d has not finished yet (a cancelled "
                        f"or timed-out wait does not stop the op). Await that op first, or "
                        f"pass another tensor."
                    )
        for _, key, start, end in entries:
            _ranges.setdefault(key, []).append((start, end, holder))
    return [tensor for _, tensor in tensors if tensor.numel()]


def release(tensors: Sequence[torch.Tensor], holder: str) -> None:
    """Frees what :func:`acquire` marked for ``holder``."""
    with _lock:
        for tensor in tensors:
            key, start, end = _key_and_range(tensor)
            ranges = _ranges.get(key)
            if not ranges:
                continue
            try:
                ranges.remove((start, end, holder))
            except ValueError:
                continue
            if not ranges:
                del _ranges[key]


def num_busy() -> int:
    """The number of busy ranges in this process (for tests and statistics)."""
    with _lock:
        return sum(len(ranges) for ranges in _ranges.values())
