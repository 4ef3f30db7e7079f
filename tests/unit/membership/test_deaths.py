"""Death notices (``agang._membership.deaths``): a watcher's word that a member died
reaches every listener on the store at once; its arguments are checked."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

import agang
from agang._membership import deaths
from agang._membership.deaths import Notice


def test_a_notice_reaches_every_listener_and_names_its_member() -> None:
    store = dist.HashStore()
    heard: list[Notice] = []
    came = threading.Event()

    def tell(notice: Notice) -> None:
        heard.append(notice)
        came.set()

    listening = deaths.Listening(store, "feature/mail", 0, tell)
    try:
        notice = Notice("node7, pid 42", "OOM-killed", "a launcher")
        assert deaths.report(store, notice) == 1
        assert came.wait(10)
        assert heard == [notice]
        assert notice.names("some-uid", "node7, pid 42")
        assert not notice.names("some-uid", "node7, pid 43")
        assert Notice.from_text(notice.to_text()) == notice
        assert notice.describe() == "reported dead by a launcher: OOM-killed"
    finally:
        listening.stop()
    assert deaths.report(store, Notice("x", "y", "z")) == 0  # its entry was taken back


def test_report_death_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="`store` must be 'HOST:PORT'"):
        agang.report_death_sync("nowhere", "host, pid 1", "why")
    with pytest.raises(TypeError, match="`who` must be a str"):
        agang.report_death_sync("127.0.0.1:1", 7, "why")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`why` must be one non-empty line"):
        agang.report_death_sync("127.0.0.1:1", "host, pid 1", "two\nlines")
    with pytest.raises(ValueError, match="`who` must be one non-empty line"):
        agang.report_death_sync("127.0.0.1:1", " ", "why")


def test_report_death_names_the_store_that_did_not_answer() -> None:
    began = time.monotonic()
    with pytest.raises(agang.GangInitError, match=r"127\.0\.0\.1:1") as raised:
        agang.report_death_sync("127.0.0.1:1", "host, pid 1", "gone", timeout=0.5)
    assert "A death notice needs" in str(raised.value)
    assert time.monotonic() - began < 0.5 + 5.0
