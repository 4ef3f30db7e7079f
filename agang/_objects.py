"""Picklable objects as byte tensors, for the two-phase object collectives.

c10d's own object collectives block and need numpy; agang's are built from two tensor
collectives (lengths, then bytes) so they are awaitable like any other op. Both phases
are read on the host, so both ask the backend for host-readable results (``to_host``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from agang._backends.contract import Backend
from agang._engine.ops import SecondPhase, Start

#: An object collective as the engine issues it: bytes, its first and second phases.
Phases = tuple[int, Start, SecondPhase]


def to_bytes(obj: Any, *, name: str) -> bytes:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"`{name}` must be picklable, but pickling it failed instead: {exc}"
        ) from exc


def length_tensor(payload: bytes | None, device: torch.device) -> torch.Tensor:
    return torch.tensor([len(payload or b"")], dtype=torch.int64, device=device)


def byte_buffer(payload: bytes | None, length: int, device: torch.device) -> torch.Tensor:
    """``payload`` padded to ``length`` bytes, or an empty buffer to receive into."""
    buffer = torch.zeros(length, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(device)


def _load(data: torch.Tensor) -> Any:
    # Through untyped storage, not numpy: numpy is not a dependency.
    data = data.cpu().contiguous()
    raw = bytes(data.untyped_storage())[
        data.storage_offset() : data.storage_offset() + data.numel()
    ]
    return pickle.loads(raw)


def replace(objects: list[Any], buffer: torch.Tensor) -> list[Any]:
    """Replaces the contents of ``objects`` with the list pickled in ``buffer``."""
    received = _load(buffer)
    objects[:] = received
    return objects


def split(gathered: torch.Tensor, lengths: torch.Tensor, longest: int) -> list[Any]:
    rows = gathered.view(-1, longest) if longest else gathered.view(len(lengths), 0)
    return [_load(row[: int(n)]) for row, n in zip(rows, lengths.tolist(), strict=True)]


def broadcast_phases(
    backend: Backend, objects: list[Any], source_rank: int, device: torch.device
) -> Phases:
    """``broadcast_objects``: the source's payload length, then the payload."""
    is_source = backend.rank == source_rank
    payload = to_bytes(objects, name="objects") if is_source else None
    length = length_tensor(payload, device)

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        buffer = byte_buffer(payload, int(length.item()), device)
        start(
            lambda done: backend.start_broadcast(buffer, source_rank, done, to_host=True),
            lambda: objects if is_source else replace(objects, buffer),
        )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_broadcast(length, source_rank, done, to_host=True)

    return len(payload or b""), first, second


def all_gather_phases(backend: Backend, obj: Any, device: torch.device) -> Phases:
    """``all_gather_objects``: every rank's payload length, then the padded payloads."""
    payload = to_bytes(obj, name="obj")
    length = length_tensor(payload, device)
    lengths = torch.zeros(backend.size, dtype=torch.int64, device=device)

    def second(start: Callable[[Start, Callable[[], Any]], None]) -> None:
        longest = int(lengths.max().item())
        buffer = byte_buffer(payload, longest, device)
        gathered = torch.empty(backend.size * longest, dtype=torch.uint8, device=device)
        start(
            lambda done: backend.start_all_gather(gathered, buffer, done, to_host=True),
            lambda: split(gathered, lengths, longest),
        )

    def first(done: Callable[[BaseException | None], None]) -> None:
        backend.start_all_gather(lengths, length, done, to_host=True)

    return len(payload), first, second
