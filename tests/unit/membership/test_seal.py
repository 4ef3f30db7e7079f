"""A membership's secret (``agang._membership.seal``): records and rendezvous values a
stranger wrote are refused, never acted on."""

from __future__ import annotations

import datetime
import logging
import threading

import pytest
import torch
import torch.distributed as dist

from agang._membership.seal import Seal, SealedStore


def test_a_sealed_record_opens_only_under_its_key_and_secret() -> None:
    seal = Seal(b"0123456789abcdef", "a test")
    sealed = seal.seal("k", "text")
    assert seal.open("k", sealed) == "text"
    assert seal.open("other", sealed) is None  # not replayed under another key
    assert Seal(b"another secret..", "a test").open("k", sealed) is None
    assert seal.open("k", "text") is None  # a stranger's record: no seal
    assert Seal(None, "a test").open("k", "text") == "text"  # no secret: as written


def test_a_refused_record_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    seal = Seal(b"0123456789abcdef", "channel 'c'")
    with caplog.at_level(logging.WARNING, logger="agang.membership"):
        for _ in range(3):
            assert seal.open("k", "forged") is None
    assert len(caplog.records) == 1
    assert "channel 'c' ignored a record under k" in caplog.records[0].getMessage()


def test_a_group_made_on_a_sealed_store_works_and_refuses_a_forged_address() -> None:
    store = dist.HashStore()
    seal = Seal(b"0123456789abcdef", "a test")
    sums: dict[int, list[float]] = {}

    def rank(index: int) -> None:
        group = dist.ProcessGroupGloo(  # type: ignore[attr-defined]
            SealedStore(dist.PrefixStore("g", store), seal), index, 2,
            datetime.timedelta(seconds=10),
        )  # fmt: skip
        tensor = torch.ones(2) * (index + 1)
        group.allreduce([tensor]).wait()
        sums[index] = tensor.tolist()

    ranks = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(30)
    assert sums == {0: [3.0, 3.0], 1: [3.0, 3.0]}
    # A stranger overwrites a member's address: reading it fails, as the rendezvous would.
    store.set("g/0/1", b"an address of the stranger's")
    with pytest.raises(RuntimeError, match="no valid seal"):
        SealedStore(dist.PrefixStore("g", store), seal).get("0/1")
