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
from agang._setup.c10d_log import quiet_c10d
from agang._weights import channel as channel_keys
from agang._weights import housekeeping
from agang._weights.channel import Channel
from agang._weights.housekeeping import Housekeeping


@pytest.fixture
def channel() -> Channel:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    return Channel.start(store, "c", "plan", "here", f"127.0.0.1:{store.port}")


def _keys(channel: Channel) -> set[str]:
    prefix = f"agang/weights/c/{channel.session}/"
    return {k.removeprefix(prefix) for k in channel.store.list_keys() if k.startswith(prefix)}


def _epoch(channel: Channel, epoch: int, size: int) -> None:
    """What an epoch of ``size`` leaves: members, check-ins, go and Gloo's rendezvous."""
    channel.set_members(epoch, [f"u{rank} n{rank} here" for rank in range(size)])
    channel.check_in(epoch, "u1")
    channel.say_go(epoch, True)
    group_store: Any = channel.group_store(epoch)
    for rank in range(size):
        group_store.set(f"0/{rank}", "address")


def test_news_come_in_order_once_each(channel: Channel) -> None:
    assert channel.register("a", "s0", "here, pid 1") == 1
    channel.leave("a")
    assert channel.register("b", "s1", "there, pid 2") == 3
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
    keeping = Housekeeping(channel)
    for epoch, size in [(0, 2), (1, 3), (2, 2)]:
        _epoch(channel, epoch, size)
        keeping.wrote_epoch(epoch, size)
    keeping.epoch_made(2)
    assert not {k for k in _keys(channel) if k.startswith(("e/0/", "e/1/"))}
    assert {k for k in _keys(channel) if k.startswith("e/2/")} == {
        "e/2/members",
        "e/2/in",
        "e/2/go",
        "e/2/pg/0/0",
        "e/2/pg/0/1",
    }
    keeping.closing()
    assert not {k for k in _keys(channel) if k.startswith("e/")}
    assert channel.epoch() == 2  # the session's own keys stay: subscribers read them


def test_drops_are_kept_for_the_last_few_and_a_live_ones_beat_stays(
    channel: Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(housekeeping, "DROPS_KEPT", 2)
    keeping = Housekeeping(channel)
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
    keeping = Housekeeping(channel)
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
    (key,) = channel._late
    mailbox_store = channel.mailbox_store("u1")
    mailbox_store.set(key, "late answer\n")
    assert mailbox_store.check([key])
    assert channel.ask(["u2"], seconds=0.05) == {"u2": None}  # the next question sweeps
    assert not mailbox_store.check([key])
    assert list(channel._late.values()) == ["u2"]
    (key2,) = channel._late
    channel.mailbox_store("u2").set(key2, "late\n")
    Housekeeping(channel).closing()  # so does the publisher's close
    assert channel._late == {}
    assert not channel.mailbox_store("u2").check([key2])


def test_a_channel_client_waits_for_an_op_past_a_network_blip(channel: Channel) -> None:
    # Connecting tries for 2 s at a time; the client's ops then wait STORE_OP_SECONDS
    # (channel rule 7): 2 s failed a server whose link had just come back.
    port = int(channel.address.rsplit(":", 1)[1])
    client = channel_keys.connect("127.0.0.1", port, time.monotonic() + 10.0)
    assert client.timeout == timedelta(seconds=channel_keys.STORE_OP_SECONDS)
    assert channel_keys.STORE_OP_SECONDS >= 10 * 2.0


def test_an_epochs_group_waits_for_a_missing_member_by_its_own_timeout(channel: Channel) -> None:
    # Gloo's rendezvous waits on the channel's client with the group's timeout, not the
    # client's STORE_OP_SECONDS (channel rule 7): a member that never comes still fails
    # the group at once.
    port = int(channel.address.rsplit(":", 1)[1])
    client = channel_keys.connect("127.0.0.1", port, time.monotonic() + 10.0)
    group_store = dist.PrefixStore("agang/weights/c/x/e/0/pg", client)  # type: ignore[attr-defined]
    started = time.monotonic()
    with quiet_c10d(), pytest.raises(Exception, match="timeout"):
        dist.ProcessGroupGloo(group_store, 0, 2, timedelta(seconds=1))  # type: ignore[attr-defined]
    assert time.monotonic() - started < channel_keys.STORE_OP_SECONDS / 3
