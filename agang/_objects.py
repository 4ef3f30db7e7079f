"""Objects as byte tensors, for the two-phase object collectives.

c10d's own object collectives block and need numpy; agang's are built from two tensor
collectives (lengths, then bytes) so they are awaitable like any other op. Both phases
are read on the host, so both ask the backend for host-readable results (``to_host``).

Rules:
1. *Decoding runs on the caller's thread.* The second phase ends with a
   :class:`~agang._future.Deferred` value: the received bytes are decoded when the
   handle's result is taken, never on c10d's threads, each rank's row from a zero-copy
   view of the received tensor.
2. *A rank that cannot encode still takes part.* It sends the length -1 in the first
   phase, so every rank skips the second phase and learns which rank failed; the op
   keeps its place in the sequence on every rank and the gang stays usable. The failing
   rank's call raises its ``TypeError`` once the op is issued.
3. *A payload that does not decode fails only that result* (a ``ValueError`` when it is
   taken): the op itself ended on every rank, so the gang stays usable.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from agang._backends.contract import Backend
from agang._engine.engine import Engine
from agang._engine.ops import SecondPhase, Start
from agang._future import Deferred
from agang._handle import Handle
from agang._serialize import Serializer, check_serializer, decode, encode

#: The first phase's length of a rank that could not encode its objects (rule 2).
REFUSED = -1


class Phases(NamedTuple):
    """An object collective as the engine issues it."""

    #: Bytes this rank sends.
    num_bytes: int
    first: Start
    second: SecondPhase
    #: Why this rank could not encode its objects (raised once issued), or None.
    refused: TypeError | None


def check_objects(objects: object, serializer: object) -> None:
    """The checks of ``broadcast_objects``'s own arguments."""
    if not isinstance(objects, list):
        raise TypeError(
            f"`objects` must be a list, but is of type `{type(objects).__name__}` instead."
        )
    check_serializer(serializer)


def issue(
    engine: Engine, op: str, seconds: float | None, phases: Phases, source_rank: int | None = None
) -> Handle[list[Any]]:
    """Issues an object collective; raises, once it is issued, why this rank refused."""
    root = "" if source_rank is None else f"source_rank={source_rank}"
    fingerprint = f"{op}({root})"
    handle = engine.issue_two_phase(
        op, seconds, phases.num_bytes, phases.first, phases.second, fingerprint=fingerprint
    )
    if phases.refused is not None:
        raise phases.refused  # issued all the same: the other ranks learn of it (rule 2)
    return handle


def _encode(obj: Any, serializer: Serializer, name: str) -> tuple[list[bytes], TypeError | None]:
    try:
        return encode(obj, serializer, name=name), None
    except TypeError as exc:
        return [], exc


def _length(parts: list[bytes], refused: TypeError | None, device: torch.device) -> torch.Tensor:
    length = REFUSED if refused is not None else sum(map(len, parts))
    return torch.tensor([length], dtype=torch.int64, device=device)


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


def _skipped(error: Exception) -> Callable[[Callable[[Start, Callable[[], Any]], None]], None]:
    """A second phase that sends nothing, whose result raises ``error``."""

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        deferred = Deferred(lambda: _raise(error))
        start(lambda done: done(None), lambda: deferred)

    return second


def _raise(error: Exception) -> Any:
    raise error


def broadcast_phases(
    backend: Backend,
    objects: list[Any],
    source_rank: int,
    device: torch.device,
    serializer: Serializer,
) -> Phases:
    """``broadcast_objects``: the source's payload length, then the payload."""
    is_source = backend.rank == source_rank
    parts, refused = _encode(objects, serializer, "objects") if is_source else ([], None)
    length = _length(parts, refused, device)

    def receive(buffer: torch.Tensor) -> list[Any]:
        host = buffer.cpu().contiguous()
        received = decode(_view(host), serializer, sender=f"rank {source_rank}")
        if type(received) is not list:
            raise ValueError(f"rank {source_rank} sent a {type(received).__name__}, not a list.")
        objects[:] = received
        return objects

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        size = int(length.item())
        if size == REFUSED:
            error = ValueError(
                f"`broadcast_objects`: rank {source_rank}, the source, could not encode its "
                f"`objects`, so nothing was sent (its call raised why); the gang is usable."
            )
            _skipped(error)(start)
            return
        buffer = _fill(parts, size, device)
        deferred = Deferred(lambda: objects if is_source else receive(buffer))
        start(
            lambda done: backend.start_broadcast(buffer, source_rank, done, to_host=True),
            lambda: deferred,
        )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_broadcast(length, source_rank, done, to_host=True)

    return Phases(sum(map(len, parts)), first, second, refused)


def all_gather_phases(
    backend: Backend, obj: Any, device: torch.device, serializer: Serializer
) -> Phases:
    """``all_gather_objects``: every rank's payload length, then the padded payloads."""
    check_serializer(serializer)
    parts, refused = _encode(obj, serializer, "obj")
    length = _length(parts, refused, device)
    lengths = torch.zeros(backend.size, dtype=torch.int64, device=device)

    def split(gathered: torch.Tensor, sizes: list[int], longest: int) -> list[Any]:
        host = gathered.cpu().contiguous()  # held while its view is read
        view = _view(host)
        return [
            decode(view[rank * longest : rank * longest + size], serializer, sender=f"rank {rank}")
            for rank, size in enumerate(sizes)
        ]

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        sizes = lengths.tolist()
        failed = [rank for rank, size in enumerate(sizes) if size == REFUSED]
        if failed:
            error = ValueError(
                f"`all_gather_objects`: rank(s) {failed} could not encode their `obj`, so "
                f"nothing was gathered (their calls raised why); the gang is usable."
            )
            _skipped(error)(start)
            return
        longest = max(sizes)
        buffer = _fill(parts, longest, device)
        gathered = torch.empty(backend.size * longest, dtype=torch.uint8, device=device)
        deferred = Deferred(lambda: split(gathered, sizes, longest))
        start(
            lambda done: backend.start_all_gather(gathered, buffer, done, to_host=True),
            lambda: deferred,
        )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_all_gather(lengths, length, done, to_host=True)

    return Phases(sum(map(len, parts)), first, second, refused)
