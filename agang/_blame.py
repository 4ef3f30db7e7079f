"""Blame: where each peer stands on an op whose deadline passed on this rank.

Pure: plain data in, text out. A rank's engine says where it stands on a gang
(``Progress``, read locally under its lock, at no cost until asked); the backend carries
the question to every peer and their answers back (``start_blame`` in
``agang._backends.contract``); this module turns the answers into the verdicts a
``GangTimeoutError`` gives, one per peer.

Rules:
1. A peer is asked about the late op by its sequence number, which is the same on every
   rank (ops are numbered in call order, and the ranks issue the same ops in the same
   order). It answers whether it has issued that op, is still waiting on it, and what the
   last op it issued was.
2. A peer that gives no answer within the backend's bound is said to have given none
   (dead, stopped, or cut off from the store); a rank that could not ask at all says so.
3. Absent ranks are those that had not issued the op, or did not answer: the ones a
   user looks at first. ``check_order``'s census names the same ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal

State = Literal["open", "broken", "closed"]


@dataclass(frozen=True)
class Progress:
    """Where one rank stands on one gang, asked about the op numbered ``asked``."""

    asked: int
    #: The last sequence number this rank issued on the gang (-1: none yet).
    issued: int
    #: That op's name (None before any).
    op: str | None
    #: The asked-about op is issued here and has not finished.
    waiting: bool
    #: How many of this rank's ops are issued and not finished.
    num_in_flight: int
    state: State

    def to_text(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> Progress:
        fields = json.loads(text)
        return cls(
            asked=int(fields["asked"]),
            issued=int(fields["issued"]),
            op=None if fields["op"] is None else str(fields["op"]),
            waiting=bool(fields["waiting"]),
            num_in_flight=int(fields["num_in_flight"]),
            state=fields["state"] if fields["state"] in ("open", "broken", "closed") else "open",
        )


#: Every peer's answer (None: no answer in time); the whole is None where the peers
#: could not be asked at all (the store did not answer).
Peers = Mapping[int, Progress | None]


def verdict(progress: Progress | None) -> str:
    """What one peer's answer says about the op it was asked about (rules 1 and 2)."""
    if progress is None:
        return "no answer (dead, stopped, or cut off from the store)"
    last = "nothing yet" if progress.issued < 0 else f"#{progress.issued} `{progress.op}`"
    if progress.state == "closed":
        return f"has closed the gang (last op issued: {last})"
    if progress.state == "broken":
        return f"its gang is broken by an earlier failure (last op issued: {last})"
    if progress.waiting:
        return "issued it and is waiting for it"
    if progress.issued < progress.asked:
        busy = f", {progress.num_in_flight} in flight" if progress.num_in_flight else ""
        return f"has not issued it (last op issued: {last}{busy})"
    return f"has finished it (last op issued: {last})"


def absent(peers: Peers) -> list[int]:
    """The peers that had not issued the op asked about, or did not answer (rule 3)."""
    return sorted(
        rank
        for rank, progress in peers.items()
        if progress is None or (progress.issued < progress.asked and progress.state == "open")
    )


def describe(peers: Peers, where: Callable[[int], str]) -> str:
    """One sentence naming every peer with its verdict, for the timeout's message."""
    if not peers:
        return ""
    parts = [f"{where(rank)}: {verdict(peers[rank])}" for rank in sorted(peers)]
    return "Peers: " + "; ".join(parts) + "."
