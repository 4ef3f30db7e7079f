"""The mailbox's responder on a real c10d ``TCPStore`` in this process: a letter it
cannot read is skipped, and it keeps answering.

The store has no authentication, so anyone who reaches it can push any line to a rank's
queue. A responder that ended on one such line would leave its rank reported "no answer"
by every blame while alive, and deaf to reform notices, for the gang's whole life.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from agang._backends.c10d import mailbox
from agang._backends.contract import Progress
from agang._setup import elastic  # registers ``ping``

WORLD_RANK = 3
GROUP = "g"

# Lines a stranger could push: wrong arity, a number that is not one, no text, a kind
# nobody registered, no kind at all, bytes that are not UTF-8.
MALFORMED: list[str | bytes] = [
    "ask x",
    "ask g not-a-number key",
    "ask g 1 key by-nothing",
    "ask",
    "ping",
    "nonsense words",
    "",
    b"\xff\xfe ask g 1 key",
]


def _progress(seq: int, collective: bool = False) -> Progress:
    return Progress(
        asked=seq,
        issued=7,
        op="all_reduce",
        waiting=False,
        num_in_flight=0,
        state="open",
        collective=3 if collective else None,
    )


@pytest.fixture
def store() -> Iterator[Any]:
    host = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        0,
        None,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=10),
    )
    yield host
    del host


@pytest.fixture
def responder(store: Any) -> Iterator[mailbox.Responder]:
    responder = mailbox.Responder(store, WORLD_RANK)
    responder.served[GROUP] = [(1, _progress)]
    yield responder
    mailbox.post(store, [WORLD_RANK], "stop", responder.token)
    responder.thread.wait(5)


def _asked(store: Any, seq: int, by: str = "") -> str | None:
    """The responder's answer to a blame question about op ``seq`` of ``GROUP``
    (``by``: what the number counts, or "" for an older rank's question)."""
    key = mailbox.reply_key("answers")
    mailbox.post(store, [WORLD_RANK], "ask", f"{GROUP} {seq} {key}{by}")
    give_up_at = time.monotonic() + 5
    while time.monotonic() < give_up_at:
        if store.check([key]):
            return str(store.get(key).decode())
        time.sleep(mailbox.POLL_SECONDS)
    return None


def test_the_responder_answers_a_ping_and_a_question(
    store: Any, responder: mailbox.Responder
) -> None:
    assert elastic.ping(store, [WORLD_RANK], 5) == {WORLD_RANK}
    assert _asked(store, 4) == f"1 {_progress(4).to_text()}\n"


def test_a_question_says_whether_its_number_counts_collectives_or_every_op(
    store: Any, responder: mailbox.Responder
) -> None:
    assert _asked(store, 2, " collective") == f"1 {_progress(2, True).to_text()}\n"
    assert _asked(store, 2, " seq") == f"1 {_progress(2).to_text()}\n"


def _push(store: Any, line: str | bytes) -> None:
    """``line`` in the responder's queue as is, as a stranger would leave it."""
    store.queue_push(f"agang/blame/{WORLD_RANK}/queue", line)


@pytest.mark.parametrize("line", MALFORMED, ids=repr)
def test_a_malformed_letter_is_skipped_and_the_responder_serves_on(
    store: Any, responder: mailbox.Responder, line: str | bytes
) -> None:
    _push(store, line)
    # Letters are read in order: these are answered only once the bad one was read.
    assert elastic.ping(store, [WORLD_RANK], 5) == {WORLD_RANK}
    assert _asked(store, 9) == f"1 {_progress(9).to_text()}\n"
    assert not responder.thread.done()


def test_skipped_letters_are_logged_with_one_warning(
    store: Any, responder: mailbox.Responder, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agang")
    for line in MALFORMED:
        _push(store, line)
    assert elastic.ping(store, [WORLD_RANK], 5) == {WORLD_RANK}
    skipped = [r.getMessage() for r in caplog.records if "skipped the letter" in r.getMessage()]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The first at WARNING; the rest at DEBUG, so a flood of them cannot flood the log.
    assert len(warnings) == 1
    assert warnings[0].getMessage() == skipped[0]
    assert "'ask x'" in skipped[0]
    assert "It serves on" in skipped[0]
    # Each letter that failed is named (the bytes as they came, escaped).
    assert any("not-a-number" in message for message in skipped)
    assert any("\\\\xff\\\\xfe ask g 1 key" in message for message in skipped)


@pytest.mark.parametrize("current", [True, False], ids=["current", "replaced"])
def test_a_lost_store_connection_is_told_for_the_current_responder_only(
    monkeypatch: pytest.MonkeyPatch, current: bool
) -> None:
    # An elastic gang breaks itself on this call: a store restarted empty holds none of
    # its state, and nobody can reach it any more. It used to end the responder quietly,
    # and the gang trained on. A responder already replaced (its gangs closed) has no
    # gang of the current callback to break.
    host = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    told: list[BaseException] = []
    mailbox.on_connection_lost(told.append)
    try:
        responder = mailbox.Responder(host, WORLD_RANK)
        monkeypatch.setattr(mailbox, "_responder", responder if current else None)
        assert elastic.ping(host, [WORLD_RANK], 5) == {WORLD_RANK}
        del host  # its server goes with it: the responder's connection fails
        responder.thread.wait(5)
    finally:
        mailbox.on_connection_lost(None)
    assert len(told) == (1 if current else 0), told


def test_the_callback_for_a_lost_connection_must_be_callable() -> None:
    with pytest.raises(TypeError, match="`callback` must be callable or None"):
        mailbox.on_connection_lost("break")  # type: ignore[arg-type]
