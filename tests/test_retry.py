"""The init retry policy and the store connection it drives, with a fake store."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import tenacity

import agang
from agang._setup import rendezvous
from agang._setup.retry import PortInUseError, is_transient

WORLD = agang.WorldInfo(
    rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=29999
)


class _FlakyStore:
    """Refuses the first ``failures`` connections, like a store that is not up yet."""

    calls = 0
    failures = 0
    message = "Connection refused"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).calls += 1
        if type(self).calls <= type(self).failures:
            raise RuntimeError(type(self).message)

    def set_timeout(self, timeout: Any) -> None:
        pass


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> type[_FlakyStore]:
    _FlakyStore.calls = 0
    monkeypatch.setattr(rendezvous.dist, "TCPStore", _FlakyStore)
    return _FlakyStore


def test_transient_failures_are_retried_with_the_injected_sleep(
    flaky: type[_FlakyStore],
) -> None:
    flaky.failures = 3
    sleeps: list[float] = []
    policy = agang.RetryPolicy(sleep=sleeps.append)

    attempts: list[None] = []
    store, port = rendezvous.open_store(
        WORLD,
        deadline=time.monotonic() + 60,
        policy=policy,
        cancelled=threading.Event(),
        on_attempt=lambda: attempts.append(None),
    )

    assert isinstance(store, _FlakyStore)
    assert (port, len(attempts)) == (29999, 4)
    assert len(sleeps) == 3
    assert sleeps[0] < sleeps[-1]  # exponential back-off


def test_the_users_stop_strategy_is_honoured(flaky: type[_FlakyStore]) -> None:
    flaky.failures = 10
    policy = agang.RetryPolicy(stop=tenacity.stop_after_attempt(2), sleep=lambda _: None)

    with pytest.raises(RuntimeError, match="refused"):
        rendezvous.open_store(
            WORLD, deadline=time.monotonic() + 60, policy=policy, cancelled=threading.Event()
        )
    assert flaky.calls == 2


def test_the_deadline_stops_retries_whatever_the_policy(flaky: type[_FlakyStore]) -> None:
    flaky.failures = 10**6
    started = time.monotonic()

    with pytest.raises(RuntimeError, match="refused"):
        rendezvous.open_store(
            WORLD,
            deadline=started + 0.3,
            policy=agang.RetryPolicy(wait=tenacity.wait_fixed(0.01)),
            cancelled=threading.Event(),
        )
    assert time.monotonic() - started < 3.0


def test_permanent_errors_are_not_retried(flaky: type[_FlakyStore]) -> None:
    flaky.failures = 1
    flaky.message = "invalid argument"
    try:
        with pytest.raises(RuntimeError, match="invalid argument"):
            rendezvous.open_store(
                WORLD,
                deadline=time.monotonic() + 60,
                policy=agang.RetryPolicy(sleep=lambda _: None),
                cancelled=threading.Event(),
            )
        assert flaky.calls == 1
    finally:
        flaky.message = "Connection refused"


def test_what_counts_as_transient() -> None:
    assert is_transient(RuntimeError("connect() failed: Connection refused"))
    assert is_transient(RuntimeError("The client socket has timed out after 2000ms"))
    assert is_transient(PortInUseError("taken", port_is_ours=True))
    assert not is_transient(PortInUseError("taken", port_is_ours=False))
    assert not is_transient(agang.GangInitError("`RANK` must be unique"))
