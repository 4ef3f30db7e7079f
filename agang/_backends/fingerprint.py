"""The order check's fingerprints: the text each rank writes for an op, and how the
ranks' texts are compared. Both sides of the backend seam speak it: the engine writes a
fingerprint, a backend carries it and compares (``start_order_check``).

Two things an op's name, shapes and dtypes cannot tell, each with its part of the text:

- *The call site.* Swapped collectives of equal op, shape and dtype have equal
  fingerprints, so order checking cannot tell them apart; in ``check_order="call_site"``
  mode each fingerprint also names the first frame outside agang that issued the op
  (file and line). Ranks that run one program issue each op from the same line; a
  program whose ranks issue an op from different lines (``if rank == 0: ... else: ...``
  with a collective in each branch) then fails the check, so the mode is for debugging,
  not for every run.
- *Split sizes.* An uneven all_to_all's split sizes differ by rank, so its fingerprint
  cannot name them, and c10d does not compare them: on Gloo a receiver that expects
  more rows than its peer sends keeps stale rows, and one that expects fewer is killed
  (SIGABRT). With order checking on, each rank's sizes (its *flows*) travel beside its
  fingerprint, and the op starts nowhere unless every pair of ranks agrees on the rows
  moved between them.

Rules:
1. *Text.* The fingerprint of such an op is two lines: the op (compared across ranks
   as any fingerprint is) and this rank's flows, ``sends 2,1,0 receives 2,0,3`` (rows to,
   and rows from, each rank of the gang). The call site, when checked, goes on the first
   line.
2. *Balance.* A rank adds a 64-bit hash of every (source, destination, rows) it sends
   and subtracts one of every (source, destination, rows) it expects to receive. Over
   all ranks the hashes cancel exactly when every pair agrees; a disagreement leaves a
   sum that is zero by a chance of 2**-64. So a check on c10d gathers two integers per
   rank (digest and balance), whatever the gang's size, and never a matrix.
3. *Report.* On a disagreement the report names the pairs that disagree, from the
   ranks' texts: all of them where every text is at hand (``FakeWorld``); on c10d, rank
   0 reads every rank's and passes on those of the ranks in the first
   ``MAX_NAMED`` disagreeing pairs (``named``), so the store carries a number of
   texts that grows with the gang's size, not its square.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

import torch

_SEPARATOR = "\n"
_MASK = (1 << 64) - 1
_OWN = "agang."


@dataclass(frozen=True)
class Flows:
    """The rows an uneven op of one rank sends to, and expects from, each rank."""

    sends: tuple[int, ...]
    receives: tuple[int, ...]

    def to_text(self) -> str:
        return f"sends {_join(self.sends)} receives {_join(self.receives)}"


def _join(rows: Sequence[int]) -> str:
    return ",".join(str(n) for n in rows)


def describe(tensor: torch.Tensor) -> str:
    """A tensor's dtype and shape, as fingerprints show it: ``float32[4, 2]``."""
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def describe_rows(tensor: torch.Tensor) -> str:
    """A tensor of rows whose number may differ by rank, as fingerprints show it:
    ``float32[*, 4]``."""
    dims = ", ".join(["*", *(str(n) for n in tensor.shape[1:])])
    return f"{str(tensor.dtype).removeprefix('torch.')}[{dims}]"


def with_flows(fingerprint: str, sends: Sequence[int], receives: Sequence[int]) -> str:
    """``fingerprint`` with this rank's flows on a second line (rule 1)."""
    return f"{fingerprint}{_SEPARATOR}{Flows(tuple(sends), tuple(receives)).to_text()}"


def at_call_site(fingerprint: str, site: str) -> str:
    """``fingerprint`` with the call site on its first line (rule 1)."""
    op, separator, flows = fingerprint.partition(_SEPARATOR)
    return f"{op} at {site}{separator}{flows}"


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


def split(text: str) -> tuple[str, Flows | None]:
    """A fingerprint's op line, and its flows where it has them."""
    op, _, flows = text.partition(_SEPARATOR)
    if not flows:
        return op, None
    _, sends, _, receives = flows.split(" ")
    return op, Flows(_parse(sends), _parse(receives))


def _parse(rows: str) -> tuple[int, ...]:
    return tuple(int(n) for n in rows.split(",")) if rows else ()


def _hash(source: int, destination: int, rows: int) -> int:
    digest = hashlib.blake2b(f"{source} {destination} {rows}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def balance(rank: int, text: str) -> int:
    """This rank's share of the balance (rule 2), as a signed 64-bit integer; 0 for a
    fingerprint without flows."""
    _, flows = split(text)
    if flows is None:
        return 0
    total = sum(_hash(rank, peer, rows) for peer, rows in enumerate(flows.sends))
    total -= sum(_hash(peer, rank, rows) for peer, rows in enumerate(flows.receives))
    return signed(total)


def signed(value: int) -> int:
    """``value`` modulo 2**64, as a signed 64-bit integer (what an int64 tensor holds)."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


def balanced(balances: Sequence[int]) -> bool:
    """Whether the ranks' balances cancel: every pair agrees (rule 2)."""
    return sum(balances) & _MASK == 0


def _disagreeing(
    texts: Mapping[int, str],
) -> Iterator[tuple[int, int, int | None, int | None]]:
    """(source, destination, rows sent, rows expected) of every pair whose flows
    disagree, in rank order."""
    flows = {rank: split(text)[1] for rank, text in texts.items()}
    for source, mine in sorted(flows.items()):
        for destination, theirs in sorted(flows.items()):
            if mine is None or theirs is None:
                continue
            sent = mine.sends[destination] if destination < len(mine.sends) else None
            expected = theirs.receives[source] if source < len(theirs.receives) else None
            if sent != expected:
                yield source, destination, sent, expected


def disagreements(texts: Mapping[int, str]) -> list[str]:
    """Every pair of ranks whose flows disagree, in words (rule 3): the ranks' texts
    must have the same op line."""
    return [
        f"rank {source} sends {sent} rows to rank {destination}, which expects {expected}"
        for source, destination, sent, expected in _disagreeing(texts)
    ]


#: How many disagreeing pairs a report names at most.
MAX_NAMED = 8


def named(texts: Mapping[int, str]) -> dict[int, str]:
    """The texts of the ranks in the first ``MAX_NAMED`` disagreeing pairs (rule 3):
    enough for the report, whatever the gang's size."""
    ranks: set[int] = set()
    for source, destination, _, _ in itertools.islice(_disagreeing(texts), MAX_NAMED):
        ranks.update((source, destination))
    return {rank: texts[rank] for rank in sorted(ranks)}


def agree(texts: Mapping[int, str]) -> bool:
    """Whether every rank's fingerprint has the same op line and their flows agree
    (checked directly, where all texts are at hand)."""
    ops = {split(text)[0] for text in texts.values()}
    return len(ops) == 1 and not disagreements(texts)
