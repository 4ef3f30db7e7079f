"""Streams of agang's own on a GPU, made outside torch's stream pool.

Why not ``torch.cuda.Stream()``: it hands out one of a fixed pool of streams per device
and priority, round-robin, and ``ProcessGroupNCCL`` takes each communicator's stream from
the same pool. After enough draws (one per sub-gang or lane, FSDP's streams, the user's
own), a stream agang got from the pool *is* some communicator's stream or a compute
stream, and agang's waits on it would then serialize foreign work, even close a wait
cycle across ranks.

Rules:
1. A side stream is created by the CUDA runtime itself (``cudaStreamCreateWithFlags``
   with ``cudaStreamNonBlocking``: it never synchronizes with the legacy default stream)
   while the gang's device is current, and wrapped for torch with
   ``torch.cuda.ExternalStream``. No other code can be handed the same stream.
2. It is destroyed when its owner (a gang's key object) is garbage: CUDA lets a stream
   with queued work be destroyed, the work still runs and the resources go after.
3. The CUDA runtime library is the one the process has loaded (torch's); when it cannot
   be found the pool is used, with a warning, rather than failing the gang.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

log = logging.getLogger("agang.cuda")

_NON_BLOCKING = 1  # cudaStreamNonBlocking


class CudaRuntimeLibrary(Protocol):
    """The two entry points of libcudart agang calls (through ctypes)."""

    def cudaStreamCreateWithFlags(self, stream: Any, flags: int) -> int: ...

    def cudaStreamDestroy(self, stream: Any) -> int: ...


def _loaded_cudart_path() -> str | None:
    """The path of the libcudart this process mapped (torch loads it), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        return None
    return None


def load_cudart() -> CudaRuntimeLibrary | None:
    """libcudart through ctypes: the mapped copy, else the linker's; None if neither."""
    candidates = [_loaded_cudart_path(), "libcudart.so"]
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        candidates.append(f"libcudart.so.{major}")
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            library: Any = ctypes.CDLL(candidate)
        except OSError:
            continue
        library.cudaStreamCreateWithFlags.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_uint,
        ]
        library.cudaStreamCreateWithFlags.restype = ctypes.c_int
        library.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
        library.cudaStreamDestroy.restype = ctypes.c_int
        return library  # type: ignore[no-any-return]
    return None


class PrivateStreams:
    """Makes private, non-blocking streams (rules 1 to 3).

    Args:
        load: Returns libcudart, or None where it cannot be loaded (tests pass a double).
    """

    def __init__(self, load: Callable[[], CudaRuntimeLibrary | None] = load_cudart) -> None:
        self._load = load
        self._library: CudaRuntimeLibrary | None = None
        self._loaded = False
        self._warned = False

    def new(self, device: torch.device, owner: object) -> Any:
        """A stream on ``device`` that no one else can get, destroyed once ``owner`` is."""
        if not self._loaded:
            self._library, self._loaded = self._load(), True
        library = self._library
        if library is None:
            return self._from_pool(device, "the CUDA runtime library could not be loaded")
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            status = library.cudaStreamCreateWithFlags(ctypes.pointer(handle), _NON_BLOCKING)
        if status != 0 or handle.value is None:
            return self._from_pool(device, f"cudaStreamCreateWithFlags returned {status}")
        stream = torch.cuda.ExternalStream(handle.value, device=device)  # type: ignore[no-untyped-call]
        weakref.finalize(owner, _destroy, library, handle.value).atexit = False
        return stream

    def _from_pool(self, device: torch.device, why: str) -> Any:
        if not self._warned:
            self._warned = True
            log.warning(
                "agang could not make a private CUDA stream (%s); its side streams come "
                "from torch's stream pool and may be shared with other work.",
                why,
            )
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def _destroy(library: CudaRuntimeLibrary, handle: int) -> None:
    library.cudaStreamDestroy(ctypes.c_void_p(handle))
