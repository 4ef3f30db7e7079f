"""Each epoch's members, the newest epoch and the check-ins (``agang._membership.roster``),
on an in-process store (c10d's ``HashStore``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from agang._membership.member import Member
from agang._membership.roster import Roster

A = Member("a", "0", "host a, pid 1")
B = Member("b", "1", "host b, pid 2")


def test_the_first_list_written_stands_and_says_who_wrote_it() -> None:
    roster = Roster(dist.HashStore(), "p")
    assert roster.members(0) is None
    assert roster.decide(0, [A, B], by="a") == ([A, B], True)
    assert roster.decide(0, [B], by="b") == ([A, B], False)
    assert roster.members(0) == [A, B]
    assert roster.decided_by(0) == "a"


def test_the_newest_epoch_never_goes_back() -> None:
    # A decider's step given up on (a cancelled push's thread) may write an older
    # epoch late: the newer one stays.
    roster = Roster(dist.HashStore(), "p")
    assert roster.newest() is None
    roster.publish(3)
    roster.publish(2)
    assert roster.newest() == 3
    roster.publish(4)
    assert roster.newest() == 4


def test_check_ins_and_forgetting_an_epoch() -> None:
    store = dist.HashStore()
    roster = Roster(store, "p")
    roster.decide(5, [A, B], by="a")
    roster.check_in(5, "a")
    roster.check_in(5, "b")
    assert roster.checked_in(5) == {"a", "b"}
    store.set(roster.key(5, "go"), "go")
    roster.forget(5, ["go"])
    assert roster.members(5) is None
    assert roster.checked_in(5) == set()
    assert not store.check([roster.key(5, "go")])


def test_a_member_is_one_line_and_its_fields_are_checked() -> None:
    member = Member.me("server-0")
    assert Member.from_text(member.to_text()) == member
    assert member.where.endswith(f"pid {member.uid.split(':')[1]}")
    with pytest.raises(ValueError, match="`uid` must be a non-empty str without spaces"):
        Member("a b", "x", "here")
