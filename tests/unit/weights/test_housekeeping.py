"""The publisher's housekeeping deletes what no one reads again, and nothing else
(``agang._weights.housekeeping``; ``agang._weights.channel`` rules 2 and 6), on a real
``TCPStore`` on 127.0.0.1 in this process."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from agang._backends.c10d import mailbox
from agang._backends.c10d.log import quiet_c10d
from agang._membership import store as stores
from agang._membership.member import Member
from agang._setup.epoch_gang import GlooEpochGangs
from agang._weights import housekeeping
from agang._weights.channel import Channel
from agang._weights.housekeeping import Housekeeping


@pytest.fixture
def channel() -> Channel:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    channel, previous = Channel.start(store, "c", "plan", "here", f"127.0.0.1:{store.port}", None)
    assert previous is None
    return channel


def _client(port: int) -> Any:
    """A weights side's client of the store at ``port``."""
    deadline = time.monotonic() + 10.0
    waits = stores.OP_SECONDS
    return stores.connect("127.0.0.1", port, deadline, need="A test needs", op_seconds=waits)


def _keeping(channel: Channel) -> Housekeeping:
    return Housekeeping(channel, GlooEpochGangs("127.0.0.1").rendezvous_keys)


def _keys(channel: Channel) -> set[str]:
    prefix = f"agang/weights/c/{channel.session}/"
    return {k.removeprefix(prefix) for k in channel.store.list_keys() if k.startswith(prefix)}


def _epoch(channel: Channel, epoch: int, size: int) -> None:
    """What an epoch of ``size`` leaves: members, check-ins, go and Gloo's rendezvous."""
    assert channel.set_members(
        epoch, [Member(f"u{rank}", f"n{rank}", "here") for rank in range(size)]
    )
    channel.check_in(epoch, "u1")
    channel.say_go(epoch, True)
    group_store: Any = dist.PrefixStore(channel.group_prefix(epoch), channel.store)  # type: ignore[attr-defined]
    for rank in range(size):
        group_store.set(f"0/{rank}", "address")


def test_news_come_in_order_once_each(channel: Channel) -> None:
    assert channel.register(Member("a", "s0", "here, pid 1")) == 1
    channel.leave("a")
    assert channel.register(Member("b", "s1", "there, pid 2")) == 3
    assert channel.news() == [
        ("join", "a s0 here, pid 1"),
        ("leave", "a"),
        ("join", "b s1 there, pid 2"),
    ]
    assert channel.news() == []
    assert channel.registered() == 3


def test_a_dead_epoch_goes_once_a_later_one_is_made_and_every_epoch_at_close(
    channel: Channel,
) -> None:
    keeping = _keeping(channel)
    for epoch, size in [(0, 2), (1, 3), (2, 2)]:
        _epoch(channel, epoch, size)
        keeping.wrote_epoch(epoch, size)
    keeping.epoch_made(2)
    assert not {k for k in _keys(channel) if k.startswith(("e/0/", "e/1/"))}
    assert {k for k in _keys(channel) if k.startswith("e/2/")} == {
        "e/2/members",
        "e/2/checked-in",
        "e/2/go",
        "e/2/seal",
        "e/2/group/0/0",
        "e/2/group/0/1",
    }
    keeping.closing()
    assert not {k for k in _keys(channel) if k.startswith("e/")}
    assert channel.epoch() == 2  # the session's own keys stay: subscribers read them


def test_drops_are_kept_for_the_last_few_and_a_live_ones_beat_stays(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(housekeeping, "DROPS_KEPT", 2)
    keeping = _keeping(channel)
    for uid in ["a", "b", "c"]:
        channel.beat(uid, 0)
        mailbox.post(channel.mailbox_store(uid), [0], "weights_status", "key")
    keeping.dropped("a", "no answer", alive=set())
    keeping.dropped("b", "no answer", alive=set())
    assert {"dropped/a", "dropped/b", "beat/a", "beat/b"} <= _keys(channel)
    keeping.dropped("c", "no answer", alive={"a"})  # a registered again: its beat stays
    assert "dropped/a" not in _keys(channel)
    assert "beat/a" in _keys(channel)
    keeping.dropped("a", "no answer, again", alive=set())  # b is the oldest now
    assert not {"dropped/b", "beat/b"} & _keys(channel)
    assert mailbox.drain(channel.mailbox_store("b"), 0, 10) == 0  # drained when forgotten
    assert mailbox.drain(channel.mailbox_store("c"), 0, 10) == 1  # c's is kept


def test_a_registration_again_deletes_the_drop_it_read_and_a_leave_everything(
    channel: Channel,
) -> None:
    keeping = _keeping(channel)
    channel.beat("a", 0)
    keeping.dropped("a", "no answer", alive=set())
    keeping.registered("a")
    assert "dropped/a" not in _keys(channel)
    assert "beat/a" in _keys(channel)
    keeping.registered("z")  # never dropped: nothing to delete
    keeping.left("a")
    assert not {k for k in _keys(channel) if k.endswith("/a")}


def test_a_late_answer_to_a_status_question_is_deleted_once_it_comes(channel: Channel) -> None:
    # No responder serves "u1": the question goes unanswered. Its answer is then written
    # late, as a server stopped across the question writes it when it wakes.
    assert channel.ask(["u1"], seconds=0.05) == {"u1": None}
    (key,) = channel._asker.late()
    mailbox_store = channel.mailbox_store("u1")
    mailbox_store.set(key, "late answer\n")
    assert mailbox_store.check([key])
    assert channel.ask(["u2"], seconds=0.05) == {"u2": None}  # the next question sweeps
    assert not mailbox_store.check([key])
    (key2,) = channel._asker.late()
    assert key2 != key
    channel.mailbox_store("u2").set(key2, "late\n")
    _keeping(channel).closing()  # so does the publisher's close
    assert channel._asker.late() == []
    assert not channel.mailbox_store("u2").check([key2])


def test_a_channel_client_waits_for_an_op_past_a_network_blip(channel: Channel) -> None:
    # Connecting tries for 2 s at a time; the weights' clients' ops then wait OP_SECONDS
    # (agang._membership.store rule 3): 2 s failed a server whose link had just come back.
    port = int(channel.address.rsplit(":", 1)[1])
    client = stores.connect(
        "127.0.0.1",
        port,
        time.monotonic() + 10.0,
        need="A test needs",
        op_seconds=stores.OP_SECONDS,
    )
    assert client.timeout == timedelta(seconds=stores.OP_SECONDS)
    assert stores.OP_SECONDS >= 10 * stores.ATTEMPT_SECONDS


def test_an_epochs_group_waits_for_a_missing_member_by_its_own_timeout(channel: Channel) -> None:
    # Gloo's rendezvous waits on the channel's client with the group's timeout, not the
    # client's OP_SECONDS (agang._membership.gangs rule 1): a member that never comes
    # fails the epoch's gang at once.
    port = int(channel.address.rsplit(":", 1)[1])
    client = stores.connect(
        "127.0.0.1",
        port,
        time.monotonic() + 10.0,
        need="A test needs",
        op_seconds=stores.OP_SECONDS,
    )
    members = [Member("p", "publisher", "here"), Member("s", "server", "there")]
    started = time.monotonic()
    with quiet_c10d(), pytest.raises(Exception, match="timeout"):
        GlooEpochGangs("127.0.0.1")(
            client, "agang/weights/c/x/e/0/group", rank=0, members=members, name="w",
            timeout=1.0, op_timeout=None,
        )  # fmt: skip
    assert time.monotonic() - started < stores.OP_SECONDS / 3
