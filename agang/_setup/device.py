"""Which device and which c10d backend a gang uses, from init's arguments and the world."""

from __future__ import annotations

import torch

from agang._setup.env import WorldInfo


def resolve_device(device: object, backend: str | None, world: WorldInfo | None) -> torch.device:
    """The gang's device: ``device`` if given, else ``cuda:LOCAL_RANK`` (modulo the GPUs
    here) when CUDA is available and the backend allows it, else the CPU."""
    if device is not None:
        try:
            return torch.device(device)  # type: ignore[call-overload,no-any-return]
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"`device` must be a torch.device or a device string, but is {device!r} instead."
            ) from exc
    if backend != "gloo" and torch.cuda.is_available():
        local_rank = world.local_rank if world is not None else 0
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_backend(backend: object, device: torch.device) -> str:
    """The c10d backend: ``backend`` if given and it fits ``device``, else by device."""
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"`backend` must be 'gloo', 'nccl' or None, but is {backend!r} instead.")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(
            f"`device` must be a CUDA device for the 'nccl' backend, but is {device} instead."
        )
    if backend == "gloo" and device.type != "cpu":
        raise ValueError(
            f"`device` must be the CPU for the 'gloo' backend, but is {device} instead."
        )
    return str(backend)
