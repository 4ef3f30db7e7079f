"""Asking members through their mailboxes (``agang._membership.questions``), on an
in-process store."""

from __future__ import annotations

import torch.distributed as dist

from agang._membership import questions


def test_a_served_member_answers_and_a_silent_one_does_not() -> None:
    store = dist.HashStore()
    alive = dist.PrefixStore("alive", store)
    served = questions.Served(alive, 0, "test_status", lambda: "well,  thank you")
    try:
        asker = questions.Asker()
        answers = asker.ask([(alive, 0), (dist.PrefixStore("dead", store), 0)], "test_status", 1.0)
        assert answers == ["well, thank you", None]
        assert len(asker.late()) == 1
    finally:
        served.stop()


def test_a_stopped_responder_ends_before_its_mailbox_is_forgotten() -> None:
    # A forget right after the stop used to pop the stop letter: the responder waited
    # for ever.
    store = dist.HashStore()
    mailbox_store = dist.PrefixStore("m", store)
    served = questions.Served(mailbox_store, 0, "test_status", lambda: "ok")
    responder = served._responder
    served.stop()
    questions.forget(mailbox_store, 0)
    assert responder.thread.done()
