"""Reading a key that may be missing (``agang._membership.store`` rule 4): one op that
never waits, on c10d's stores, even where another client deletes the key meanwhile."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from storeutil import DeletedAsItIsRead

from agang._membership import store as stores

#: The clients' op timeout here: a read that waits for a deleted key waits this long.
WAIT = timedelta(seconds=2)


def _tcp() -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=WAIT
    )


STORES: dict[str, Callable[[], Any]] = {
    "tcp": _tcp,
    "hash": dist.HashStore,
    "prefix": lambda: dist.PrefixStore("p", _tcp()),  # type: ignore[attr-defined]
}


@pytest.mark.parametrize("make", STORES.values(), ids=list(STORES))
def test_a_missing_key_reads_as_none_and_an_empty_one_as_empty(make: Callable[[], Any]) -> None:
    store = make()
    assert stores.read(store, "k") is None
    assert not store.check(["k"])  # the read wrote nothing
    store.set("k", "")
    assert stores.read(store, "k") == ""
    store.set("k", "a\nb\n")
    assert stores.read(store, "k") == "a\nb\n"
    assert stores.lines(store, "k") == ["a", "b"]
    store.delete_key("k")
    assert stores.read(store, "k") is None
    assert stores.lines(store, "k") == []


def test_a_key_deleted_as_it_is_read_reads_at_once_and_leaves_the_client_free() -> None:
    """A read after a check waited the client's whole timeout for a key deleted in
    between, holding the client: every thread sharing it waited too (35 s of a weights
    channel's close in a test, whose store waits 300 s)."""
    server = _tcp()
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=WAIT)  # type: ignore[attr-defined]
    client.set("drop", "why")
    racing = DeletedAsItIsRead(client, server, "drop")
    began = time.monotonic()
    value = stores.read(racing, "drop")
    took = time.monotonic() - began
    assert racing.deleted
    assert value in ("why", None)  # as it was before the delete, or after it
    assert took < WAIT.total_seconds() / 4, took
    client.set("beat", "1")  # the client is free at once
    assert time.monotonic() - began < WAIT.total_seconds() / 2
    assert not server.check(["drop"])  # the read put nothing back
