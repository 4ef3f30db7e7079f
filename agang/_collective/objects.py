"""The object collectives, checked and described: objects as byte tensors, in two phases.

c10d's own object collectives block and need numpy; agang's are built from two tensor
collectives (lengths, then bytes) so they are awaitable like any other op. Both phases
are read on the host, so both ask the backend for host-readable results (``to_host``).
Each function checks its call against the gang's ``agang._collective.checks.Group``
and returns the ``Phases`` the gang issues as one two-phase op; their documentation
is the ``Gang``'s.

Rules:
1. *Decoding runs on the caller's thread.* The second phase ends with a
   ``agang._runtime.future.Deferred`` value: the received bytes are decoded when the
   handle's result is taken, never on c10d's threads, each rank's row from a zero-copy
   view of the received tensor.
2. *Small payloads need one phase.* The first phase sends a fixed slot per rank: the
   payload's length, then the payload itself when it fits the slot. Only a payload too
   big for it is sent again, whole, in a second phase of the longest payload's size.
3. *A rank that cannot encode still takes part.* It sends the length -1 in the first
   phase, so every rank skips the second phase and learns which rank failed; the op
   keeps its place in the sequence on every rank and the gang stays usable. The failing
   rank's call raises its ``TypeError`` once the op is issued.
4. *A payload that does not decode fails only that result* (a ``ValueError`` when it is
   taken): the op itself ended on every rank, so the gang stays usable.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from agang._backends.contract import Backend
from agang._collective.checks import Group
from agang._collective.serialize import check_serializer, decode, encode
from agang._engine.ops import SecondPhase, Start
from agang._gang import Serializer
from agang._runtime.future import Deferred
from agang._validate import check_rank

#: The first phase's length of a rank that could not encode its objects (rule 3).
REFUSED = -1
#: The first phase's slot: a little-endian int64 length, then the payload if it fits.
BROADCAST_SLOT = 4096
_LENGTH = struct.Struct("<q")


class Phases(NamedTuple):
    """An object collective as the engine issues it (``Engine.issue_two_phase``)."""

    #: The collective's name.
    name: str
    #: Bytes this rank sends.
    num_bytes: int
    first: Start
    second: SecondPhase
    #: What every rank must agree on: the op and its root.
    fingerprint: str
    #: Why this rank could not encode its objects, or None: the gang raises it once the
    #: op is issued (rule 3).
    refused: TypeError | None


def broadcast_objects(
    group: Group, backend: Backend, objects: list[Any], source_rank: int, serializer: Serializer
) -> Phases:
    if not isinstance(objects, list):
        raise TypeError(
            f"`objects` must be a list, but is of type `{type(objects).__name__}` instead."
        )
    check_serializer(serializer)
    source_rank = check_rank(source_rank, group.size, name="source_rank")
    return _broadcast_phases(backend, objects, source_rank, group.device, serializer)


def all_gather_objects(group: Group, backend: Backend, obj: Any, serializer: Serializer) -> Phases:
    check_serializer(serializer)
    return _all_gather_phases(backend, obj, group.device, serializer)


def gather_slot(size: int) -> int:
    """The all-gather's first-phase slot per rank: 4 KiB, less from 16 ranks up."""
    return max(256, min(4096, 65536 // size))


def _encode(obj: Any, serializer: Serializer, name: str) -> tuple[list[bytes], TypeError | None]:
    try:
        return encode(obj, serializer, name=name), None
    except TypeError as exc:
        return [], exc


def _first(
    parts: list[bytes], refused: TypeError | None, slot: int, device: torch.device
) -> torch.Tensor:
    """This rank's first-phase slot (rule 2)."""
    length = REFUSED if refused is not None else sum(map(len, parts))
    inline = parts if 0 <= length <= slot - _LENGTH.size else []
    return _fill([_LENGTH.pack(length), *inline], slot, device)


def _fill(parts: list[bytes], length: int, device: torch.device) -> torch.Tensor:
    """``parts`` copied once into a buffer of ``length`` bytes, zero-padded."""
    buffer = torch.empty(length, dtype=torch.uint8)
    at = buffer.data_ptr()
    for part in parts:
        ctypes.memmove(at, part, len(part))
        at += len(part)
    buffer[at - buffer.data_ptr() :].zero_()
    return buffer.to(device)


def _view(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host uint8 tensor, not copied; valid while it lives."""
    if data.numel() == 0:
        return memoryview(b"")
    array = (ctypes.c_char * data.numel()).from_address(data.data_ptr())
    return memoryview(array).cast("B")


def _decode_rows(
    data: torch.Tensor, rows: list[tuple[int, int]], serializer: Serializer
) -> list[Any]:
    """The objects at ``(offset, length)`` in ``data``, each rank's row read in place."""
    host = data.cpu().contiguous()  # held while its view is read
    view = _view(host)
    return [
        decode(view[at : at + length], serializer, sender=f"rank {rank}")
        for rank, (at, length) in enumerate(rows)
    ]


def _finish(start: Callable[[Start, Callable[[], Any]], None], compute: Callable[[], Any]) -> None:
    """Ends a two-phase op after its first phase: no second phase is needed."""
    deferred = Deferred(compute)
    start(lambda done: done(None), lambda: deferred)


def _raise(error: Exception) -> Any:
    raise error


def _broadcast_phases(
    backend: Backend,
    objects: list[Any],
    source_rank: int,
    device: torch.device,
    serializer: Serializer,
) -> Phases:
    """``broadcast_objects``: the source's slot (length, and a small payload), then the
    payload if it did not fit."""
    is_source = backend.rank == source_rank
    parts, refused = _encode(objects, serializer, "objects") if is_source else ([], None)
    slot = _first(parts, refused, BROADCAST_SLOT, device)

    def receive(data: torch.Tensor, at: int, length: int) -> list[Any]:
        if is_source:
            return objects
        (received,) = _decode_rows(data, [(at, length)], serializer)
        if type(received) is not list:
            raise ValueError(f"rank {source_rank} sent a {type(received).__name__}, not a list.")
        objects[:] = received
        return objects

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        host = slot.cpu()
        (length,) = _LENGTH.unpack_from(_view(host))
        if length == REFUSED:
            error = ValueError(
                f"`broadcast_objects`: rank {source_rank}, the source, could not encode its "
                f"`objects`, so nothing was sent (its call raised why); the gang is usable."
            )
            _finish(start, lambda: _raise(error))
        elif length <= BROADCAST_SLOT - _LENGTH.size:
            _finish(start, lambda: receive(host, _LENGTH.size, length))
        else:
            buffer = _fill(parts, length, device)
            deferred = Deferred(lambda: receive(buffer, 0, length))
            start(
                lambda done: backend.start_broadcast(buffer, source_rank, done, to_host=True),
                lambda: deferred,
            )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_broadcast(slot, source_rank, done, to_host=True)

    fingerprint = f"broadcast_objects(source_rank={source_rank})"
    return Phases("broadcast_objects", sum(map(len, parts)), first, second, fingerprint, refused)


def _all_gather_phases(
    backend: Backend, obj: Any, device: torch.device, serializer: Serializer
) -> Phases:
    """``all_gather_objects``: every rank's slot (length, and a small payload), then the
    padded payloads if one did not fit."""
    parts, refused = _encode(obj, serializer, "obj")
    size, slot_bytes = backend.size, gather_slot(backend.size)
    mine = _first(parts, refused, slot_bytes, device)
    slots = torch.empty(size * slot_bytes, dtype=torch.uint8, device=device)

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        host = slots.cpu()
        view = _view(host)
        lengths = [_LENGTH.unpack_from(view, r * slot_bytes)[0] for r in range(size)]
        failed = [rank for rank, length in enumerate(lengths) if length == REFUSED]
        longest = max(lengths)
        if failed:
            error = ValueError(
                f"`all_gather_objects`: rank(s) {failed} could not encode their `obj`, so "
                f"nothing was gathered (their calls raised why); the gang is usable."
            )
            _finish(start, lambda: _raise(error))
        elif longest <= slot_bytes - _LENGTH.size:
            rows = [(r * slot_bytes + _LENGTH.size, n) for r, n in enumerate(lengths)]
            _finish(start, lambda: _decode_rows(host, rows, serializer))
        else:
            buffer = _fill(parts, longest, device)
            gathered = torch.empty(size * longest, dtype=torch.uint8, device=device)
            rows = [(r * longest, n) for r, n in enumerate(lengths)]
            deferred = Deferred(lambda: _decode_rows(gathered, rows, serializer))
            start(
                lambda done: backend.start_all_gather(gathered, buffer, done, to_host=True),
                lambda: deferred,
            )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_all_gather(slots, mine, done, to_host=True)

    return Phases(
        "all_gather_objects", sum(map(len, parts)), first, second, "all_gather_objects()", refused
    )
