"""Picklable objects as byte tensors, for the two-phase object collectives.

c10d's own object collectives block and need numpy; agang's are built from two tensor
collectives (lengths, then bytes) so they are awaitable like any other op.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch


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
