"""Where the user called a collective: for order checking's call-site mode.

Swapped collectives of equal op, shape and dtype have equal fingerprints, so order
checking cannot tell them apart; in ``check_order="call_site"`` mode each fingerprint
also names the first frame outside agang that issued the op (file and line). Ranks that
run one program issue each op from the same line; a program whose ranks issue an op from
different lines (``if rank == 0: ... else: ...`` with a collective in each branch) then
fails the check, so the mode is for debugging, not for every run.
"""

from __future__ import annotations

import sys
from types import FrameType

_OWN = "agang."


def call_site() -> str:
    """``file:line`` of the innermost frame outside agang (``<unknown>`` if none: an op
    issued from a C++ callback such as an autograd hook)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "agang" or name.startswith(_OWN)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"
