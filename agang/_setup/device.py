"""Which device and which c10d backend a gang uses, from init's arguments and the world."""

from __future__ import annotations

import torch

from agang._setup.env import WorldInfo


def resolve_device(device: object, backend: str | None, world: WorldInfo | None) -> torch.device:
    """The gang's device: ``device`` if given, else ``cuda:LOCAL_RANK`` (modulo the GPUs
    here) when CUDA is available and the backend allows it, else the CPU.

    A bare ``"cuda"`` means this rank's GPU, as ``None`` does: every later step needs an
    index (``torch.cuda.set_device``, ``init_process_group(device_id=...)``, and the
    check that a tensor is on the gang's device, which ``cuda`` and ``cuda:0`` fail).
    """
    if device is not None:
        try:
            chosen = torch.device(device)  # type: ignore[call-overload]
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"`device` must be a torch.device or a device string, but is {device!r} instead."
            ) from exc
        if chosen.type != "cuda" or chosen.index is not None:
            return chosen  # type: ignore[no-any-return]
        if not torch.cuda.is_available():
            raise ValueError(
                f"`device` must be a device this machine has, but is {device!r} and CUDA is "
                f"not available here."
            )
        return torch.device("cuda", _local_gpu(world))
    if backend != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", _local_gpu(world))
    return torch.device("cpu")


def _local_gpu(world: WorldInfo | None) -> int:
    local_rank = world.local_rank if world is not None else 0
    return local_rank % torch.cuda.device_count()


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
