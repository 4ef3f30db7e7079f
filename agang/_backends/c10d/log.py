"""c10d's C++ log while agang connects to the store: quiet by default, and why.

While the store's host is late, every connection try of c10d's ``TCPStore`` client logs
a warning or error to stderr with a C++ stack trace of some 25 ``frame #`` lines (torch
2.13). agang already waits for the host and retries, so a service's log would fill with
traces of nothing wrong. Rules:

1. While agang itself opens the store (hosting it, or connecting to it, in
   ``agang._setup.rendezvous`` and ``agang._setup.elastic``), c10's C++ log
   threshold is raised to FATAL and put back afterwards. agang says instead, at INFO on
   the ``agang`` logger, one line per retry; the final error is ``GangInitError``.
2. Nothing is changed where the user asked for c10d's output: ``AGANG_DEBUG=1``, or any
   of ``TORCH_LOG_VARIABLES`` set. Of these, ``TORCH_CPP_LOG_LEVEL`` and
   ``TORCH_SHOW_CPP_STACKTRACES`` are the ones that change these traces (measured on
   torch 2.13: ``TORCH_DISTRIBUTED_DEBUG``, ``TORCH_LOGS`` and ``TORCH_DISABLE_ADDR2LINE``
   do not); ``TORCH_DISTRIBUTED_DEBUG`` asks for c10d's diagnostics, so it counts too.
3. torch reads those variables once, when it is imported: setting them at ``init`` is
   too late. The threshold itself, c10's global ``FLAGS_caffe2_log_level``, is read at
   every message, so agang writes it (through ``ctypes``, in torch's ``libc10``). Where
   that symbol is not found (another platform or build), nothing is changed.
4. The threshold is process-wide. Sections may nest or overlap (probe threads): the
   first one in raises it, the last one out puts back the value it found. Only
   set-up's connection attempts are quiet, never the gang's own ops.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

DEBUG_VARIABLE = "AGANG_DEBUG"
#: torch's own variables that, set by the user, leave c10d's log as torch makes it.
TORCH_LOG_VARIABLES = (
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES",
    "TORCH_DISTRIBUTED_DEBUG",
)
# c10's severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL (which aborts, and is kept).
_FATAL = 3
_LIBRARY_NAMES = ("libc10.so", "libc10.dylib", "c10.dll")

_lock = threading.Lock()
_depth = 0
_saved_level: int | None = None
_flag_found = False  # looked up once, at the first quiet section
_flag: ctypes.c_int | None = None


def c10d_output_wanted(env: Mapping[str, str]) -> str | None:
    """The variable in ``env`` that asks for c10d's own output (rule 2), or None.

    Raises:
        TypeError: ``env`` is not a mapping.
    """
    if not isinstance(env, Mapping):
        raise TypeError(f"`env` must be a mapping, but is {env!r} instead.")
    if env.get(DEBUG_VARIABLE, "").strip() not in ("", "0"):
        return DEBUG_VARIABLE
    return next((name for name in TORCH_LOG_VARIABLES if name in env), None)


def _find_log_level_flag() -> ctypes.c_int | None:
    """c10's ``FLAGS_caffe2_log_level``, in the ``libc10`` torch loaded; None if absent."""
    import torch

    library_dir = Path(torch.__file__).parent / "lib"
    for name in _LIBRARY_NAMES:
        path = library_dir / name
        if not path.exists():
            continue
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(str(path)), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            return None
    return None


def _log_level_flag() -> ctypes.c_int | None:
    global _flag_found, _flag
    if not _flag_found:
        _flag = _find_log_level_flag()
        _flag_found = True
    return _flag


def can_quiet() -> bool:
    """Whether this torch build lets agang raise c10's log threshold (rule 3)."""
    return _log_level_flag() is not None


@contextmanager
def quiet_c10d(env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Raises c10's C++ log threshold to FATAL within the ``with`` block (rules 1, 4),
    unless ``env`` (``os.environ`` by default) asks for c10d's output (rule 2).

    Example:
        <!-- not-run: needs a rendezvous store listening at host:port -->
        ```python
        with quiet_c10d():
            store = dist.TCPStore(host, port, is_master=False)
        ```
    """
    env = os.environ if env is None else env
    flag = None if c10d_output_wanted(env) else _log_level_flag()
    if flag is None:
        yield
        return
    _enter(flag)
    try:
        yield
    finally:
        _leave(flag)


def _enter(flag: ctypes.c_int) -> None:
    global _depth, _saved_level
    with _lock:
        if _depth == 0:
            _saved_level = flag.value
            flag.value = max(flag.value, _FATAL)
        _depth += 1


def _leave(flag: ctypes.c_int) -> None:
    global _depth, _saved_level
    with _lock:
        _depth -= 1
        if _depth == 0 and _saved_level is not None:
            flag.value = _saved_level
            _saved_level = None
