"""Death notices (``agang._membership.deaths``): a watcher's word that a member died
reaches every listener on the store at once; its arguments are checked."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from storeutil import DeletedAsItIsRead

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


def test_a_listener_that_stops_as_a_notice_reads_its_entry_holds_the_notice_up_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its entry deleted between the reporter's look at it and its read: the read waited
    for the entry the client's whole timeout (300 s on a weights test's store), holding
    the client, and then failed the report."""
    wait = timedelta(seconds=2)
    server = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=wait
    )
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=wait)  # type: ignore[attr-defined]
    listening = deaths.Listening(client, "feature/mail", 0, lambda _: None)
    try:
        entry = next(k for k in server.list_keys() if k.startswith("agang/deaths/listen/"))
        racing = DeletedAsItIsRead(client, server, entry)
        # A letter to a mailbox of a client that is not c10d's: through the client it wraps.
        prefix_store = dist.PrefixStore  # type: ignore[attr-defined]

        def unwrapped(prefix: str, store: Any) -> Any:
            return prefix_store(prefix, getattr(store, "store", store))

        monkeypatch.setattr(dist, "PrefixStore", unwrapped)
        began = time.monotonic()
        told = deaths.report(racing, Notice("node7, pid 42", "OOM-killed", "a launcher"))
        assert racing.deleted
        assert told in (0, 1)  # read before the delete, or after it
        assert time.monotonic() - began < wait.total_seconds() / 4
    finally:
        listening.stop()


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
