"""The init retry policy and the store connection it drives, with a fake store."""

from __future__ import annotations

import dataclasses
import gc
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import tenacity
import torch.distributed as dist
from netutil import free_port

import agang
from agang._backends.c10d.retry import (
    PortInUseError,
    RetryPolicy,
    TransientSetupError,
    call_c10d,
    is_address_in_use,
    is_transient,
    retrying,
    transient_from_c10d,
)
from agang._policy import make_policy
from agang._setup import rendezvous
from agang._setup.init import _Plan

WORLD = agang.WorldInfo(
    rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port=29999
)


# What torch 2.13's TCPStore client raises when nobody listens on the port yet: c10d
# retries the refused connection itself until its timeout, then gives up with this
# (measured by test_c10d_errors_are_classified_by_type below).
_NOT_UP = (
    "The client socket has timed out after 1000ms while trying to connect to (127.0.0.1, 29999)."
)


class _FlakyStore:
    """Fails the first ``failures`` connections, like a store that is not up yet."""

    calls = 0
    failures = 0
    error: Callable[[], Exception] = staticmethod(lambda: dist.DistNetworkError(_NOT_UP))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).calls += 1
        if type(self).calls <= type(self).failures:
            raise type(self).error()

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

    with pytest.raises(TransientSetupError, match="timed out") as raised:
        rendezvous.open_store(
            WORLD, deadline=time.monotonic() + 60, policy=policy, cancelled=threading.Event()
        )
    assert isinstance(raised.value.__cause__, dist.DistNetworkError)
    assert flaky.calls == 2


def test_the_deadline_stops_retries_whatever_the_policy(flaky: type[_FlakyStore]) -> None:
    flaky.failures = 10**6
    started = time.monotonic()

    with pytest.raises(TransientSetupError, match="timed out"):
        rendezvous.open_store(
            WORLD,
            deadline=started + 0.3,
            policy=agang.RetryPolicy(wait=tenacity.wait_fixed(0.01)),
            cancelled=threading.Event(),
        )
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    "error",
    [
        lambda: RuntimeError("invalid argument"),
        lambda: dist.DistStoreError("wait timeout after 1000ms, keys: /agang/init/0/rank/0"),
    ],
    ids=["plain", "store-wait-timeout"],
)
def test_permanent_errors_are_not_retried(
    flaky: type[_FlakyStore], monkeypatch: pytest.MonkeyPatch, error: Callable[[], Exception]
) -> None:
    flaky.failures = 1
    monkeypatch.setattr(flaky, "error", staticmethod(error))
    with pytest.raises(RuntimeError) as raised:
        rendezvous.open_store(
            WORLD,
            deadline=time.monotonic() + 60,
            policy=agang.RetryPolicy(sleep=lambda _: None),
            cancelled=threading.Event(),
        )
    assert str(raised.value) == str(error())  # raised as c10d raised it
    assert flaky.calls == 1


def test_what_counts_as_transient() -> None:
    # c10d's errors, classified where c10d is called, by type.
    assert transient_from_c10d(dist.DistNetworkError(_NOT_UP)) is not None
    assert transient_from_c10d(dist.DistNetworkError("Connection reset by peer")) is not None
    assert transient_from_c10d(ConnectionResetError("reset")) is not None
    in_use = dist.DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 29999, "
        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    )
    assert is_address_in_use(in_use)
    assert transient_from_c10d(in_use) is None  # PortInUseError decides
    assert transient_from_c10d(dist.DistStoreError("wait timeout after 1000ms")) is None
    assert transient_from_c10d(agang.GangInitError("`RANK` must be unique")) is None
    # What is retried: the type alone.
    assert is_transient(TransientSetupError("the store is not up yet"))
    assert is_transient(PortInUseError("taken", port_is_ours=True))
    assert not is_transient(PortInUseError("taken", port_is_ours=False))
    assert not is_transient(agang.GangInitError("`RANK` must be unique"))
    assert not is_transient(dist.DistNetworkError(_NOT_UP))  # not yet through call_c10d


def test_the_text_test_is_only_for_plain_runtime_errors_from_c10d() -> None:
    # Gloo's transport words a refused or reset connection as a plain RuntimeError: only
    # there does the text decide.
    assert transient_from_c10d(RuntimeError("connect [127.0.0.1]:1234: Connection refused"))
    assert transient_from_c10d(RuntimeError("read: Connection reset by peer"))
    assert transient_from_c10d(RuntimeError("Connection closed by peer [127.0.0.1]:1")) is None
    # The same words on any other type are no sign of a transient failure.
    for error in (
        dist.DistStoreError("Connection refused"),
        PortInUseError("connection refused", port_is_ours=False),
        agang.GangInitError("connection refused"),
        ValueError("connection refused"),
        OSError("connection refused"),
    ):
        assert transient_from_c10d(error) is None, error
    assert not is_transient(RuntimeError("Connection refused"))


def test_call_c10d_raises_transient_failures_from_the_original() -> None:
    original = dist.DistNetworkError(_NOT_UP)

    def fails() -> None:
        raise original

    with pytest.raises(TransientSetupError) as raised:
        call_c10d(fails)
    assert raised.value.__cause__ is original
    assert "connection refused" not in str(raised.value).lower()

    def permanent() -> None:
        raise agang.GangInitError("`RANK` must be unique")

    with pytest.raises(agang.GangInitError):
        call_c10d(permanent)
    assert call_c10d(lambda: 3) == 3


def _attempts(raise_first: Callable[[], BaseException], failures: int) -> tuple[int, object]:
    calls = 0
    outcome: object = None
    try:
        for attempt in retrying(
            RetryPolicy(stop=tenacity.stop_after_attempt(5), sleep=lambda _: None),
            time.monotonic() + 60,
        ):
            with attempt:
                calls += 1
                if calls <= failures:
                    raise raise_first()
                outcome = "done"
    except BaseException as error:
        outcome = error
    return calls, outcome


def test_agangs_own_transient_errors_are_retried_by_type() -> None:
    calls, outcome = _attempts(lambda: TransientSetupError("The store is closing."), 2)
    assert (calls, outcome) == (3, "done")


def test_a_permanent_error_is_not_retried() -> None:
    calls, outcome = _attempts(lambda: agang.GangInitError("`RANK` must be unique"), 2)
    assert calls == 1
    assert isinstance(outcome, agang.GangInitError)


@pytest.mark.parametrize(
    "error",
    [
        lambda: RuntimeError("connect() failed: Connection refused"),
        lambda: agang.GangInitError("connection refused by the firewall"),
        lambda: ValueError("Connection refused"),
    ],
    ids=["runtime-error", "gang-init-error", "value-error"],
)
def test_a_message_naming_a_refused_connection_is_not_retried(
    error: Callable[[], BaseException],
) -> None:
    calls, outcome = _attempts(error, 2)
    assert calls == 1
    assert type(outcome) is type(error())


class _DictStore:
    """Just enough of a c10d store for check_in; ``late`` keys appear after one look."""

    def __init__(self, late: dict[str, str] | None = None, **keys: str) -> None:
        self.keys = {key: value.encode() for key, value in keys.items()}
        self.late = late or {}

    def check(self, keys: list[str]) -> bool:
        found = all(key in self.keys for key in keys)
        for key in keys:
            if key in self.late:
                self.keys[key] = self.late.pop(key).encode()
        return found

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def add(self, key: str, amount: int) -> int:
        value = int(self.keys.get(key, b"0")) + amount
        self.keys[key] = str(value).encode()
        return value


@pytest.mark.parametrize(
    ("store", "words"),
    [
        (lambda: _DictStore(**{"p/missing": "1"}), "is closing"),
        (lambda: _DictStore(late={"p/missing": ""}), "finished round"),
        (lambda: _DictStore(late={"p/missing": "0"}), "joins the next one"),
    ],
    ids=["closing", "finished", "ended-without-a-rank"],
)
def test_check_in_at_a_store_of_an_earlier_round_is_transient_by_type(
    store: Callable[[], _DictStore], words: str
) -> None:
    with pytest.raises(TransientSetupError, match=words) as raised:
        rendezvous.check_in(
            store(), WORLD, "p", deadline=time.monotonic() + 60, cancelled=threading.Event()
        )
    assert raised.value.__cause__ is None
    assert not any(
        marker in str(raised.value).lower() for marker in ("connection", "reset", "refused")
    )


def test_the_store_host_names_the_missing_ranks_within_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The host lingers, so the others learn who is missing, inside its deadline, not past
    # it: with a 2 s linger and a 1 s deadline it once failed after 3 s. A 30 s linger
    # puts that failure at 31 s, far from the deadline and from the bound below, which a
    # loaded machine's late polls (0.25 s apart at most) stay well within.
    monkeypatch.setattr(rendezvous, "HOST_LINGER", 30.0)
    store = _DictStore()
    host = dataclasses.replace(WORLD, rank=0)
    started = time.monotonic()
    with pytest.raises(agang.GangInitError, match=r"Ranks \[1\] of 2 did not check in"):
        rendezvous.check_in(store, host, "p", deadline=started + 1.0, cancelled=threading.Event())
    took = time.monotonic() - started
    assert store.get("p/missing") == b"1"  # published for the others
    assert 0.9 < took < 6.0, took  # a linger past the deadline takes 31 s


def test_open_store_retries_a_check_in_at_a_closing_store(flaky: type[_FlakyStore]) -> None:
    flaky.failures = 0
    stores = iter([_DictStore(**{"p/missing": "1"}), _DictStore(), _DictStore()])
    checked: list[object] = []

    def check_in(store: object) -> None:
        store = next(stores)
        checked.append(store)
        rendezvous.check_in(
            store, WORLD, "p", deadline=time.monotonic() + 0.5, cancelled=threading.Event()
        )

    with pytest.raises(agang.GangInitError, match="did not check in"):
        rendezvous.open_store(
            WORLD,
            deadline=time.monotonic() + 60,
            policy=agang.RetryPolicy(sleep=lambda _: None),
            cancelled=threading.Event(),
            then=check_in,
        )
    assert len(checked) == 2  # the closing store was retried; the missing rank was not


def _plan_of(world: agang.WorldInfo) -> _Plan:
    """An init plan of ``world`` over Gloo with a 1 s deadline, for its failure messages."""
    return _Plan(
        backend="gloo",
        device=None,
        timeout=1,
        policy=make_policy(op_timeout=1, env={}),
        env={},
        world=world,
        in_process=False,
        stream_ordered=False,
        retry=None,
    )


def test_a_transient_failure_is_reported_with_c10ds_own_error_as_its_cause() -> None:
    plan = _plan_of(agang.WorldInfo(1, 2, 1, "127.0.0.1", 29999))
    original = dist.DistNetworkError(_NOT_UP)

    def fails() -> None:
        raise original

    with pytest.raises(TransientSetupError) as raised:
        call_c10d(fails)
    failure = plan.report(raised.value)
    assert failure.__cause__ is original
    # c10d's sentence, its full stop dropped where agang's figures follow in brackets.
    assert f"{_NOT_UP.rstrip('.')} (after " in str(failure)


def test_an_init_failure_says_where_the_world_came_from() -> None:
    def message(
        world: agang.WorldInfo,
        error: BaseException | None = None,
    ) -> str:
        plan = _plan_of(world)
        late = agang.GangInitError("Ranks [1] of 2 did not check in.", missing_ranks=[1])
        return str(plan.report(late if error is None else error))

    # agang's own diagnosis stands alone: no guessed causes, no count of no attempts.
    world = agang.WorldInfo(1, 2, 1, "127.0.0.1", 29999)
    diagnosed = message(world, agang.GangInitError("`RANK` must be unique, but ..."))
    assert "Likely causes" not in diagnosed
    assert "attempt(s)" not in diagnosed
    missing = agang.GangInitError("Ranks [1] of 2 did not check in.", missing_ranks=[1])
    assert "Likely causes: a rank was not started" in message(world, missing)
    by_hand = agang.WorldInfo(1, 2, 1, "127.0.0.1", 29999, source="torchrun")
    launched = dataclasses.replace(by_hand, job_id="none")  # torchrun always sets it
    assert "from RANK/WORLD_SIZE variables) failed: Ranks [1]" in message(by_hand)
    assert "from torchrun) failed: Ranks [1] of 2 did not check in (after " in message(launched)


@pytest.fixture
def listener() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as error:
        return error
    raise AssertionError("no error")


def test_c10d_errors_are_classified_by_type(listener: int) -> None:
    """What the real TCPStore raises in the failures set-up meets, and their class."""
    short = timedelta(seconds=0.2)
    # A store that is not up yet: c10d retries until its timeout.
    not_up = _raised(
        lambda: dist.TCPStore("127.0.0.1", free_port(), 2, is_master=False, timeout=short)
    )
    assert type(not_up) is dist.DistNetworkError
    assert transient_from_c10d(not_up) is not None
    # A host whose port is taken.
    in_use = _raised(
        lambda: dist.TCPStore(
            "127.0.0.1", listener, 2, is_master=True, timeout=short, wait_for_workers=False
        )
    )
    assert type(in_use) is dist.DistNetworkError
    assert is_address_in_use(in_use)
    assert transient_from_c10d(in_use) is None
    # A store whose host goes away while a client uses it.
    port = free_port()
    host = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=short, wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=short)
    host.set("key", "value")
    assert client.get("key") == b"value"
    del host
    gc.collect()
    gone = _raised(lambda: client.check(["key"]))
    assert type(gone) is dist.DistNetworkError
    assert transient_from_c10d(gone) is not None
    # A wait for a key nobody sets: the deadline, not a transient failure.
    port = free_port()
    alone = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=short, wait_for_workers=False
    )
    waited = _raised(lambda: alone.get("never"))
    assert type(waited) is dist.DistStoreError
    assert transient_from_c10d(waited) is None
