"""Each epoch's members in the store, the newest epoch, and the members' check-ins.

A membership moves from epoch to epoch; each epoch has its own keys under the
feature's prefix (``<prefix>/e/<n>/...``), so that nothing of an old epoch leaks into
a new one.

Rules (every call may block: call them off the event loop):
1. *One decision per epoch.* An epoch's member list is written once, by compare-and-set
   on an empty key, with the id of who decided on its first line: a leaderless decider
   (an elastic reform) takes whichever list won, and a led one (the weights'
   publisher, the only writer) always wins. Every reader reads that one list.
2. *The newest epoch* is one key that the decider sets once the list is written, so a
   reader that finds the pointer finds the list. It never goes back: a decider's step
   that was given up on (a cancelled push's thread, say) and writes an older epoch late
   leaves the newer one there.
3. *Check-ins.* Each member says, under its epoch, that it read the list and is
   making the epoch's group (one line, its uid); the decider or the members learn who
   came from them, and who did not.
4. The feature's own keys of an epoch (elastic's arrivals, the weights' go, each
   group's rendezvous) live under the same prefix (``key``), and ``forget`` deletes an
   epoch's keys once no one will read them again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agang._membership import store as stores
from agang._membership.member import Member


def epoch_key(prefix: str, epoch: int, name: str) -> str:
    """The key ``name`` of ``epoch`` of the membership under ``prefix`` (rule 4)."""
    return f"{prefix}/e/{epoch}/{name}"


class Roster:
    """The epochs of one membership under ``prefix`` on ``store`` (module rules)."""

    def __init__(self, store: Any, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def key(self, epoch: int, name: str) -> str:
        """The key ``name`` of ``epoch`` (rule 4)."""
        return epoch_key(self.prefix, epoch, name)

    # Rules 1, 2: the decision and the newest epoch.

    def decide(self, epoch: int, members: list[Member], by: str) -> tuple[list[Member], bool]:
        """Writes ``members`` as ``epoch``'s, unless a list is there already; returns the
        list that stands, and whether it is this one (rule 1)."""
        text = "\n".join([f"by {by}", *(m.to_text() for m in members)]) + "\n"
        stored = self.store.compare_set(self.key(epoch, "members"), "", text).decode()
        return _members(stored), stored == text

    def members(self, epoch: int) -> list[Member] | None:
        """``epoch``'s decided members, or None before the decision (or once forgotten)."""
        text = stores.read(self.store, self.key(epoch, "members"))
        return None if text is None else _members(text)

    def decided_by(self, epoch: int) -> str | None:
        """The id of whoever wrote ``epoch``'s list (rule 1), or None before."""
        found = stores.lines(self.store, self.key(epoch, "members"))
        return found[0].removeprefix("by ") if found else None

    def publish(self, epoch: int) -> None:
        """Says that ``epoch`` is the newest, unless a newer one is (rule 2)."""
        key = f"{self.prefix}/epoch"
        for _ in range(100):  # another decider may move it between the read and the set
            current = stores.read(self.store, key)
            if current is not None and int(current) >= epoch:
                return
            if self.store.compare_set(key, current or "", str(epoch)).decode() == str(epoch):
                return

    def newest(self) -> int | None:
        """The newest epoch whose members were decided, or None before the first."""
        text = stores.read(self.store, f"{self.prefix}/epoch")
        return None if text is None else int(text)

    # Rule 3: check-ins.

    def check_in(self, epoch: int, uid: str) -> None:
        self.store.append(self.key(epoch, "checked-in"), f"{uid}\n")

    def checked_in(self, epoch: int) -> set[str]:
        return set(stores.lines(self.store, self.key(epoch, "checked-in")))

    # Rule 4.

    def forget(self, epoch: int, names: Iterable[str] = ()) -> None:
        """Deletes ``epoch``'s list and check-ins, and its keys ``names``."""
        for name in ("members", "checked-in", *names):
            self.store.delete_key(self.key(epoch, name))


def _members(text: str) -> list[Member]:
    return [Member.from_text(line) for line in text.splitlines()[1:] if line]
